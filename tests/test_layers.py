"""The package layers only point down (docs/architecture.md): core at the bottom, mrope_kernels and data on it, the
model room (modeling) on those, the run's lifecycle on the model room, inference (generation and scores) and the
trainer on both, verification on the trainer, scripts and train.py on top. train.py hands the training loop its
generation evaluation, so the trainer never imports inference. Every import counts, module-level or inside a
function; no package has an exception, and no module imports itself back through others (no loop).
docs/architecture.md states the same rules, and its claims are held to the code here too."""

from __future__ import annotations

import ast
import re
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
            if top in FIRST_PARTY and top not in ALLOWED[package]:
                wrong.add(f"{relative} imports {name}")
    assert not wrong, sorted(wrong)


def first_party_modules() -> dict[str, Path]:
    """Every first-party module by dotted name (packages' __init__ under the package's own name), train.py included."""
    modules = {"train": ROOT / "train.py"}
    for package in FIRST_PARTY - {"train"}:
        for path in (ROOT / package).glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def module_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The first-party modules `path` imports, at any depth of its code: `from a.b import c` imports the module a.b.c
    where there is one (a package's module), else a.b (a name defined in a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                names.add(name if name in modules else node.module)
    return {name for name in names if name in modules}


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): each is an import loop."""
    index, low, stack, on_stack, loops = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                loops.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return loops


def test_import_loops_are_found():
    """The loop finder reports a loop of two and one of three, and nothing for a chain (so the next test can fail)."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "f"}, "f": set()}
    assert sorted(import_loops(graph)) == [["a", "b"], ["c", "d", "e"]]
    assert import_loops({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_imports_itself_back():
    """No first-party module reaches itself through its imports (module-level or inside a function): each
    module's dependencies can be read, and imported, without it."""
    modules = first_party_modules()
    graph = {name: module_imports(path, modules) - {name} for name, path in modules.items()}
    assert not import_loops(graph)


# Imports each module named after the code, then prints the root logger's handlers and level, or the first module
# after whose import the root logger has a handler
IMPORT_AND_REPORT_ROOT_LOGGER = """
import importlib, logging, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
    if logging.root.handlers:
        break
print(name, logging.root.handlers, logging.getLevelName(logging.root.level))
"""


@pytest.mark.slow  # a fresh process imports every module (~8 s); test_train.py checks train.py's own log fast
def test_no_module_configures_logging_when_imported():
    """Importing train.py and every first-party module, scripts included, leaves the root logger as Python starts it:
    no handler, level WARNING. A handler added on import (rouge-score logs through absl when its scorer is built
    without a tokenizer, and that first call configures the root logger) turns train.py's logging.basicConfig into a
    no-op, and the run's log goes silent."""
    import subprocess
    import sys

    names = sorted(first_party_modules())
    command = [sys.executable, "-c", IMPORT_AND_REPORT_ROOT_LOGGER, *names]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == f"{names[-1]} [] WARNING", result.stdout


ARCHITECTURE = ROOT / "docs" / "architecture.md"
ROOM_ROW = re.compile(r"^\| `(\w+)/` \| (.+) \|$", re.MULTILINE)
UPWARD_LINE = re.compile(r"^Upward imports, each by its module: (.+)$", re.MULTILINE)
NAMED_IMPORT = re.compile(r"`([\w/]+\.py)`\s+imports\s+`([\w.]+)`")
# "`data/config.py` imports only `core.config_tree` and `data.synthetic`", "`x.py` imports nothing first-party"
IMPORTS_ONLY = re.compile(
    r"`([\w/]+\.py)`\s+imports\s+(only\s+((?:`[\w.]+`(?:,\s+|\s+and\s+)?)+)|nothing\s+first-party)"
)


def layers_section() -> str:
    """docs/architecture.md's "## Layers" section."""
    text = ARCHITECTURE.read_text()
    start = text.index("## Layers\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def first_party_imports(relative: str) -> set[str]:
    return {name for name in imported_modules(ROOT / relative) if name.split(".")[0] in FIRST_PARTY}


def test_architecture_states_the_rules_the_code_keeps():
    """docs/architecture.md's table of what each room may import is ALLOWED, room by room (which every import of
    the code keeps: test_package_imports_only_lower_layers), and it lists no upward import, as the code makes none:
    the page cannot promise a layering the code does not have."""
    section = layers_section()
    rooms = {}
    for room, cell in ROOM_ROW.findall(section):
        rooms[room] = {room} | (set() if cell == "nothing first-party" else set(re.findall(r"`(\w+)`", cell)))
    assert rooms == ALLOWED
    line = UPWARD_LINE.search(section)
    assert line, "the Layers section lists no upward imports (write 'Upward imports, each by its module: none.')"
    assert line.group(1) == "none." and not NAMED_IMPORT.findall(line.group(1)), line.group(1)


def test_architecture_drawing_shows_every_room_once():
    """The Layers drawing shows train.py, scripts/ and each room of ALLOWED exactly once, as a label (a name after two
    spaces: the drawing's columns; a description may name a room after one)."""
    section = layers_section()
    drawing = section[section.index("```") : section.index("```", section.index("```") + 3)]
    for room in ["train.py", "scripts/", *(f"{package}/" for package in ALLOWED)]:
        found = re.findall(rf"(?<=\s\s){re.escape(room)}(?=\s)", drawing)
        assert len(found) == 1, f"{room} appears {len(found)} times in the drawing"


def test_architecture_imports_only_claims_hold():
    """Each "`<module>` imports only `<a>` and `<b>`" and "`<module>` imports nothing first-party" in
    docs/architecture.md names exactly that module's first-party imports."""
    claims = IMPORTS_ONLY.findall(ARCHITECTURE.read_text())
    assert claims, "docs/architecture.md makes no imports-only claim to check"
    for module, _, names in claims:
        assert first_party_imports(module) == set(re.findall(r"`([\w.]+)`", names)), module


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


PRODUCT = ["train.py", "Makefile", "requirements.txt", *FIRST_PARTY - {"train"}]
OWN_HOSTS_SETUP = "scripts/gpu_env.sh"


def test_our_gpu_hosts_setup_lives_in_one_script():
    """What only the project's own GPU hosts need (wheels carried in .whl/) is in scripts/gpu_env.sh alone: no
    package, script, train.py or Makefile target installs from carried wheels."""
    paths = [ROOT / name for name in PRODUCT if (ROOT / name).is_file()]
    paths += [p for name in PRODUCT if (ROOT / name).is_dir() for p in sorted((ROOT / name).glob("*.*"))]
    offenders = [
        p.relative_to(ROOT).as_posix()
        for p in paths
        if p.suffix in {".py", ".sh", ".txt", ""}
        and ".whl" in p.read_text()
        and p.relative_to(ROOT).as_posix() != OWN_HOSTS_SETUP
    ]
    assert not offenders
    assert ".whl" in (ROOT / OWN_HOSTS_SETUP).read_text()


def private_uses(path: Path) -> set[str]:
    """`from x import _y` of a first-party module, and `alias._y` on a first-party module bound by an import."""
    tree = ast.parse(path.read_text())
    found, modules = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] not in FIRST_PARTY:
                continue
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.add(f"from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)  # a module or a name: reading `_y` off either is private
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FIRST_PARTY:
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        private = isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        if private and isinstance(node.value, ast.Name) and node.value.id in modules:
            found.add(f"{node.value.id}.{node.attr}")
    return found


# The kernel tests that look inside the launch path on purpose: a recording JIT in place of the Triton kernels
# (direct launch), the op's per-signature cache and its autograd.Function, the patch's record of replaced functions.
WHITE_BOX_READS = {
    "test_direct_launch.py": {"triton_rope._rope_kernel", "triton_rope._vision_table_kernel"},
    "test_bench_mrope.py": {"ops._RopeFunction", "ops._rope"},
    "test_kernels.py": {"ops._ROPES"},
    "test_patch.py": {"patch_module._GLOBAL_PATCHES", "patch_module._make_text_apply"},
}


def test_tests_use_only_public_names_of_other_modules():
    """No test imports an underscored name of a first-party module (`from x import _y`), and none reads one off an
    imported module (`module._y`) beyond the kernel white-box reads named in WHITE_BOX_READS: tests go through the
    public interfaces."""
    offenders = {
        f"{path.name}: {use}"
        for path in sorted((ROOT / "tests").glob("*.py"))
        for use in private_uses(path)
        if use.startswith("from ") or use not in WHITE_BOX_READS.get(path.name, set())
    }
    assert not offenders, sorted(offenders)
