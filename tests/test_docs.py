"""The documentation and the result files keep their promises: every result file says where it comes from, every
link in the docs resolves, the README stays short, and the repo's text stands on its own (no labels of work periods,
no references to files outside the repository). Pure file checks: nothing is built or imported from the project."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
RESULT_FILES = sorted(RESULTS.glob("*.json"))
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 220

COMMIT = re.compile(r"[0-9a-f]{7,40}")
SOURCE_DIGEST = re.compile(r"[0-9a-f]{64}")
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...
# a repo path in backticks in the README: a slash, a known suffix, no placeholder or wildcard
README_PATH = re.compile(r"`([A-Za-z0-9_.\-/]+/[A-Za-z0-9_.\-]+\.(?:py|yaml|sh|txt|md|json|toml))`")
ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|"
    "fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-\\w+"
)
# across a line break too, where a comment's "#" or a docstring's indentation may sit between the two words
ORDINAL_PERIOD = re.compile(rf"\b({ORDINALS})(?:\s|#)+sessions?\b", re.IGNORECASE)
# a path under docs/ named anywhere in the repo's text
DOCS_PATH = re.compile(r"\bdocs/[A-Za-z0-9_.\-/]*[A-Za-z0-9_\-]\.(?:md|json|png|txt)\b")
OUTSIDE_REFERENCES = ("ANCHORS.md", "PITFALLS.md", "NOTES-transformers.md", "../shared")
TEXT_SUFFIXES = {".md", ".py", ".yaml", ".yml", ".sh", ".toml", ".txt", ".json"}
TEXT_NAMES = {"Makefile", ".ci/run"}
SKIPPED_DIRS = {".git", ".venv", "venv", "artifacts", "runs", "wandb", ".cache", ".whl", "__pycache__"}


def provenance_of(result: dict) -> dict | None:
    """A result file's provenance: its top-level "provenance" object, or the "environment" object of a
    compare_throughput comparison.json (the same object under that script's name for it)."""
    record = result.get("provenance", result.get("environment"))
    return record if isinstance(record, dict) else None


def repo_text_files() -> list[Path]:
    """The repository's text files: tracked and untracked-but-not-ignored (git), else a walk that skips the
    environment and run outputs; this test file itself is left out (it spells the patterns it looks for)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        paths = [ROOT / name for name in listed]
    except (OSError, subprocess.CalledProcessError):
        paths = [
            path for path in ROOT.rglob("*") if not any(part in SKIPPED_DIRS for part in path.relative_to(ROOT).parts)
        ]
    here = Path(__file__).resolve()
    return sorted(
        path
        for path in paths
        if path.is_file()
        and not path.is_symlink()
        and path.resolve() != here
        and (path.suffix in TEXT_SUFFIXES or path.relative_to(ROOT).as_posix() in TEXT_NAMES or path.name in TEXT_NAMES)
    )


def markdown_links(path: Path) -> list[str]:
    """Every link target in a Markdown file, code blocks and inline code left out."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    return MARKDOWN_LINK.findall(text)


def test_the_results_directory_holds_result_files():
    """docs/results holds JSON result files, so the per-file checks below are not vacuous."""
    assert RESULT_FILES, f"no result files in {RESULTS}"


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda path: path.name)
def test_every_result_file_records_its_provenance(path):
    """Every result JSON records where it comes from, so it reproduces from the file alone: a top-level
    "provenance" object (or compare_throughput's "environment") with a clean commit or the source digest, the GPU
    and its count, and the versions of torch, Triton and transformers; and nothing in the file names a tree with
    uncommitted changes ("-dirty")."""
    text = path.read_text()
    result = json.loads(text)
    assert isinstance(result, dict), "a result file is a JSON object"
    record = provenance_of(result)
    assert record is not None, 'no "provenance" (or compare_throughput "environment") object at the top level'
    commit, digest = record.get("commit"), record.get("source_sha256")
    assert commit is not None or digest is not None, "neither a commit nor a source digest"
    if commit is not None:
        assert isinstance(commit, str) and COMMIT.fullmatch(commit), f"commit {commit!r} is not a clean hash"
    if digest is not None:
        assert isinstance(digest, str) and SOURCE_DIGEST.fullmatch(digest), f"source_sha256 {digest!r}"
    gpu = record.get("gpu")
    assert isinstance(gpu, dict) and gpu.get("name") and isinstance(gpu.get("count"), int), f"gpu {gpu!r}"
    for library in ("torch", "triton", "transformers"):
        assert isinstance(record.get(library), str) and record[library], f"no {library} version"
    assert "-dirty" not in text, "the file names a tree with uncommitted changes"


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda path: path.name)
def test_every_result_file_is_cited_by_the_docs(path):
    """docs/results keeps only the files the documentation cites: each is linked from the README, the changelog or
    a page of docs/ (a measurement nobody points to is history, which git keeps)."""
    cited = {
        (doc.parent / target.split("#")[0]).resolve() for doc in DOCS if doc.exists() for target in markdown_links(doc)
    }
    assert path.resolve() in cited, f"{path.name} is linked from no page of the docs"


@pytest.mark.parametrize("doc", [doc for doc in DOCS if doc.exists()], ids=lambda doc: doc.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    """Every relative link in the README, the changelog and docs/*.md points at a file or directory that exists in
    the repository (anchors and external URLs aside)."""
    missing = []
    for target in markdown_links(doc):
        if EXTERNAL.match(target) or target.startswith("#"):
            continue
        relative = target.split("#")[0].split("?")[0]
        resolved = (doc.parent / relative).resolve()
        if not resolved.exists() or not resolved.is_relative_to(ROOT):
            missing.append(target)
    assert not missing, f"{doc.name}: links to nothing: {missing}"


def test_readme_repo_paths_exist():
    """Every repo path the README names in backticks (a directory and a file with a known suffix) exists."""
    named = README_PATH.findall((ROOT / "README.md").read_text())
    assert named, "the README names no path (the pattern is wrong)"
    missing = [name for name in named if not (ROOT / name).exists()]
    assert not missing, f"README names paths that do not exist: {missing}"


def test_readme_is_short():
    """The README is a user's guide a newcomer reads in minutes: at most README_MAX_LINES lines; the reference
    lives in docs/."""
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def matches_by_line(pattern: re.Pattern, paths: list[Path]) -> list[str]:
    """`path:line: match` for every match of `pattern` in the text of `paths` (a match may span lines)."""
    found = []
    for path in paths:
        text = path.read_text(errors="replace")
        for match in pattern.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {' '.join(match.group(0).split())}")
    return found


def test_no_text_is_labelled_by_ordinal_work_periods():
    """No text file of the repository (docs, code, recipes, scripts, results, Makefile) names a measurement or a
    change by an ordinal work period (a session or phase counted in words): a reader has only dates and commits."""
    offenders = matches_by_line(ORDINAL_PERIOD, repo_text_files())
    assert not offenders, "ordinal period labels:\n" + "\n".join(offenders)


def test_no_text_refers_to_files_outside_the_repository():
    """No text file of the repository points at files that live outside it (the workspace's shared notes): what a
    reader needs is in the repo."""
    pattern = re.compile("|".join(re.escape(name) for name in OUTSIDE_REFERENCES))
    offenders = matches_by_line(pattern, repo_text_files())
    assert not offenders, "references outside the repository:\n" + "\n".join(offenders)


def test_docs_paths_named_in_the_repo_exist():
    """Every docs/ file the repository's text names (code comments, docstrings, recipes, the docs themselves)
    exists. The historical records are exempt: the changelog and the result files' provenance may name files that
    git keeps only in history, and say at which commit."""
    paths = [path for path in repo_text_files() if path != ROOT / "CHANGELOG.md" and path.parent != RESULTS]
    offenders = [hit for hit in matches_by_line(DOCS_PATH, paths) if not (ROOT / hit.rsplit(": ", 1)[1]).exists()]
    assert not offenders, "docs paths that do not exist:\n" + "\n".join(offenders)
