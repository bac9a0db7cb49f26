"""The package layers only point down (docs/architecture.md): core at the bottom, mrope_kernels and data on it,
training on those, verification and inference on training, scripts on top. Every import counts, module-level or inside
a function. train.py hands the training loop its generation evaluation (inference/), so training never imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"core", "data", "mrope_kernels", "training", "verification", "inference", "scripts", "train"}
# package -> the first-party packages its modules may import (itself included)
ALLOWED = {
    "core": {"core"},
    "mrope_kernels": {"core", "mrope_kernels"},
    "data": {"core", "data"},
    "training": {"core", "data", "mrope_kernels", "training"},
    "verification": {"core", "data", "mrope_kernels", "training", "verification"},
    "inference": {"core", "data", "mrope_kernels", "training", "inference"},
}


def imported_modules(path: Path) -> set[str]:
    """Dotted names of every module `path` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_lower_layers(package):
    """No module of a package imports a first-party package above it (so data never imports training, and
    training never imports verification or scripts)."""
    files = sorted((ROOT / package).glob("*.py"))
    assert files, f"{package}/ has no modules"
    wrong = {
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in imported_modules(path)
        if name.split(".")[0] in FIRST_PARTY and name.split(".")[0] not in ALLOWED[package]
    }
    assert not wrong, sorted(wrong)


def test_triton_kernels_do_not_import_transformers():
    """The Triton kernel layer is usable without transformers (flash-attention's rotary layering)."""
    names = imported_modules(ROOT / "mrope_kernels" / "triton_rope.py")
    assert not {n for n in names if n.split(".")[0] in {"transformers", *FIRST_PARTY} - {"mrope_kernels"}}


def test_scripts_run_as_modules_without_path_edits():
    """Scripts run as `python -m scripts.x` from the repository root: none edits sys.path to find the packages."""
    offenders = [path.name for path in sorted((ROOT / "scripts").glob("*.py")) if "sys.path" in path.read_text()]
    assert not offenders


@pytest.mark.slow
def test_installed_repo_runs_scripts_by_path_too(tmp_path):
    """`make install` installs the repo (editable), so a script also runs by its path, from any directory; without
    that install only `python -m scripts.x` from the repo root works."""
    import importlib.metadata
    import subprocess
    import sys

    try:
        importlib.metadata.distribution("qwen-vl-packed-train")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the repo is not installed in this environment (make install does it)")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "inspect_data.py"), "--help"], cwd=tmp_path, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert b"--config" in done.stdout


def test_inference_uses_only_what_sits_below_the_trainer():
    """inference/ builds models, adapters and checkpoints, never the training loop, step or setup: the trainer calls
    it (train.generate_every), so it must stay below the trainer."""
    below_trainer = {"training.config", "training.modeling", "training.lora", "training.checkpoint"}
    wrong = {
        f"{path.name} imports {name}"
        for path in sorted((ROOT / "inference").glob("*.py"))
        for name in imported_modules(path)
        if name.split(".")[0] == "training" and name not in below_trainer
    }
    assert not wrong, sorted(wrong)
