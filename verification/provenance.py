"""Where a result comes from, recorded in every result file a script writes, so it reproduces from the file alone.

    python -m verification.provenance      # this tree's provenance, as the scripts record it

`provenance()` gives the commit when the checkout is a clean git tree; a copy without git (a working tree copied
to another machine) or with uncommitted changes gets no commit, only `source_sha256`, the digest of the files that
decide what runs (SOURCE_GLOBS), which the same call at a commit's checkout reproduces. Beside it: the date, the
GPU and the versions of every library that can move a number (fla and Liger-Kernel where installed).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The files whose contents decide what a run computes (and so what a result measured)
SOURCE_GLOBS = (
    "train.py",
    "core/*.py",
    "data/*.py",
    "mrope_kernels/*.py",
    "modeling/*.py",
    "lifecycle/*.py",
    "trainer/*.py",
    "verification/*.py",
    "scripts/*.py",
    "scripts/*.sh",
    "recipes/**/*.yaml",
    "recipes/models/*.json",
    "requirements*.txt",
)
# Distributions whose versions a result records (None where not installed)
LIBRARIES = {
    "torch": "torch",
    "triton": "triton",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "fla": "flash-linear-attention",
    "liger_kernel": "liger-kernel",
}


def source_sha256(root: Path = ROOT) -> str:
    """sha256 over the relative path and bytes of every SOURCE_GLOBS file under `root`, in path order."""
    digest = hashlib.sha256()
    paths = sorted({path for pattern in SOURCE_GLOBS for path in root.glob(pattern) if path.is_file()})
    for path in paths:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def clean_commit(root: Path = ROOT) -> str | None:
    """The checkout's HEAD commit when no tracked file differs from it; None without git, outside a repository, or
    with uncommitted changes (a result is then named by `source_sha256` alone)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        )
    except FileNotFoundError:
        return None
    if head.returncode != 0 or changed.returncode != 0 or changed.stdout.strip():
        return None
    return head.stdout.strip()


def library_versions() -> dict[str, str | None]:
    """The installed version of each of LIBRARIES, None where it is not installed."""
    versions = {}
    for name, distribution in LIBRARIES.items():
        try:
            versions[name] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def gpu() -> dict:
    """The visible GPUs: {"name", "count"} ({"name": "cpu (<machine>)", "count": 0} without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {"name": f"cpu ({platform.machine()})", "count": 0}
    return {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}


def provenance() -> dict:
    """{commit, source_sha256, date_utc, gpu, python, <library>: version} for a result file (module docstring)."""
    return {
        "commit": clean_commit(),
        "source_sha256": source_sha256(),
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "gpu": gpu(),
        "python": platform.python_version(),
        **library_versions(),
    }


if __name__ == "__main__":
    print(json.dumps(provenance(), indent=2))
