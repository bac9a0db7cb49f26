"""The package layers only point down (docs/architecture.md): core at the bottom, mrope_kernels and data on it, the
model room (modeling) on those, the run's lifecycle on the model room, inference (generation and scores) and the
trainer on both, verification on the trainer, scripts and train.py on top. train.py hands the training loop its
generation evaluation, so the trainer never imports inference. Every import counts, module-level or inside a
function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {
    "core",
    "data",
    "mrope_kernels",
    "modeling",
    "lifecycle",
    "trainer",
    "inference",
    "verification",
    "scripts",
    "train",
}
# package -> the first-party packages its modules may import (itself included)
ALLOWED = {
    "core": {"core"},
    "mrope_kernels": {"core", "mrope_kernels"},
    "data": {"core", "data"},
    "modeling": {"core", "data", "mrope_kernels", "modeling"},
    # a checkpoint holds the model's LoRA adapters and exports them in peft's format (modeling/lora.py)
    "lifecycle": {"core", "data", "mrope_kernels", "modeling", "lifecycle"},
    "trainer": {"core", "data", "mrope_kernels", "modeling", "lifecycle", "trainer"},
    # builds a run's model, adapters and checkpoints as training does; never its loop, step or setup
    "inference": {"core", "data", "mrope_kernels", "modeling", "lifecycle", "inference"},
    "verification": {"core", "data", "mrope_kernels", "modeling", "lifecycle", "trainer", "verification"},
}
# The one upward reach, by module: the recipe schema (core/config.py) composes the data and packing sections that
# data/config.py declares beside the code that reads them; data/config.py itself imports only core.config_tree and
# data.synthetic (the built-in kinds it validates), which imports nothing first-party.
ALLOWED_MODULES = {"core/config.py": {"data.config"}}
MAX_MODULES = 16  # a package folder a reader can take in at once


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
    """No module of a package imports a first-party package above it (so data never imports modeling, modeling never
    imports the lifecycle or the trainer, and none of them imports verification or scripts)."""
    files = sorted((ROOT / package).glob("*.py"))
    assert files, f"{package}/ has no modules"
    wrong = set()
    for path in files:
        relative = path.relative_to(ROOT).as_posix()
        for name in imported_modules(path):
            top = name.split(".")[0]
            if top in FIRST_PARTY and top not in ALLOWED[package] and name not in ALLOWED_MODULES.get(relative, ()):
                wrong.add(f"{relative} imports {name}")
    assert not wrong, sorted(wrong)


def test_data_config_stays_below_the_recipe_schema():
    """data/config.py, which core/config.py imports, imports nothing first-party but core.config_tree and
    data.synthetic, which itself imports nothing first-party, so the one upward reach of core cannot close a cycle."""
    names = {n for n in imported_modules(ROOT / "data" / "config.py") if n.split(".")[0] in FIRST_PARTY}
    assert names <= {"core.config_tree", "data.synthetic"}, sorted(names)
    synthetic = {n for n in imported_modules(ROOT / "data" / "synthetic.py") if n.split(".")[0] in FIRST_PARTY}
    assert not synthetic, sorted(synthetic)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_folders_stay_small(package):
    """No package folder holds more modules than a reader takes in at once (training/ held 30 side by side)."""
    modules = [path.name for path in (ROOT / package).glob("*.py") if path.name != "__init__.py"]
    assert len(modules) <= MAX_MODULES, sorted(modules)


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
