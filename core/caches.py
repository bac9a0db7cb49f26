"""Caches that read back, or are built again: one warning line names the cache and what is wrong.

Caches are derived data, so a damaged one (a disk that filled mid-write, a copy killed half-way, a truncated file)
is rebuilt, never trusted and never a traceback:

- directories built once and reused (the built-in dataset, the tiny processor) carry MANIFEST, every file's size and
  checksum, written before the directory is renamed into place; one whose files do not match it is moved aside and
  built again, under a lock, so the ranks of a node rebuild it once;
- datasets' arrow caches (the records read from a JSON or parquet file, the listing of image files, the processed
  samples): one that does not read back, or holds another number of rows than it should, is removed and computed
  again.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
from filelock import FileLock

logger = logging.getLogger("data.pipeline")  # the pipeline's log, which users filter by
MANIFEST = "MANIFEST.json"
# What reading a damaged cache raises: pyarrow's short reads (OSError, ArrowInvalid), truncated JSON. Narrow on
# purpose: a DataError (a ValueError) is the data's, never the cache's.
READ_ERRORS = (OSError, json.JSONDecodeError, pa.ArrowException)


def _digest(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "blake2b").hexdigest()[:32]


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path) -> None:
    """MANIFEST in `directory`: {relative path: [size in bytes, checksum]} of every file under it."""
    files = {str(p.relative_to(directory)): [p.stat().st_size, _digest(p)] for p in _files(directory)}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, sort_keys=True))


def manifest_problem(directory: Path) -> str | None:
    """None when `directory`'s files are exactly those its MANIFEST lists, with their sizes and checksums; else the
    first difference, in words."""
    try:
        listed = json.loads((directory / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{MANIFEST} does not read back ({error})"
    try:  # another process may be moving a damaged directory aside meanwhile
        present = {str(p.relative_to(directory)): p for p in _files(directory)}
        for name, (size, checksum) in sorted(listed.items()):
            path = present.pop(name, None)
            if path is None:
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, not {size}"
            if _digest(path) != checksum:
                return f"{name} does not match its checksum"
    except OSError as error:
        return _one_line(error)
    if present:
        return f"{sorted(present)[0]} is not in {MANIFEST}"
    return None


def _sibling(directory: Path, tag: str) -> Path:
    # the host too: on a filesystem shared by nodes, their processes' pids repeat (containers)
    return directory.with_name(f"{directory.name}.{tag}-{socket.gethostname()}-{os.getpid()}")


def built_directory(directory: Path, build: Callable[[Path], None], what: str) -> Path:
    """`directory` as `build(staging)` writes it: reused when its files match its MANIFEST, else (absent or
    damaged) built into a staging sibling, given a MANIFEST and renamed into place, under a lock in the parent's
    locks/; a damaged one is said in one warning line and moved aside first. `what` names the cache in that line."""
    directory = Path(directory)
    if manifest_problem(directory) is None:
        return directory
    (directory.parent / "locks").mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory.parent / "locks" / f"{directory.name}.lock")):
        problem = manifest_problem(directory) if directory.exists() else None
        if directory.exists() and problem is None:  # another process built it while this one waited
            return directory
        if directory.exists():
            logger.warning("%s %s does not read back (%s): building it again", what, directory, problem)
            aside = _sibling(directory, "damaged")
            directory.rename(aside)
            shutil.rmtree(aside, ignore_errors=True)
        staging = _sibling(directory, "tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        build(staging)
        write_manifest(staging)
        try:
            staging.rename(directory)
        except OSError:  # a process on another node (where the lock does not reach) finished first
            shutil.rmtree(staging, ignore_errors=True)
            if manifest_problem(directory) is not None:
                raise
    return directory


def _one_line(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())


def map_cache_files(dataset, fingerprint: str) -> list[str]:
    """The arrow files `dataset.map(..., new_fingerprint=fingerprint)` caches its result in (one, or one per
    process), where they exist; none for a dataset without cache files (in memory: nothing is cached)."""
    if not dataset.cache_files:
        return []
    stem, suffix = os.path.splitext(dataset._get_cache_file_path(fingerprint))
    return sorted(glob.glob(glob.escape(stem) + "*" + suffix))


def mapped(dataset, fingerprint: str, run_map: Callable[[], object], what: str):
    """`run_map()` (a `dataset.map` with `new_fingerprint=fingerprint`), which loads its cached result when there
    is one; a cached result that does not read back or holds another number of rows than `dataset` is removed (one
    warning line naming it) and computed again."""
    cached = map_cache_files(dataset, fingerprint)
    if not cached:
        return run_map()
    try:
        result = run_map()
        if len(result) == len(dataset):
            return result
        problem = f"{len(result)} rows for {len(dataset)} records"
    except READ_ERRORS as error:
        problem = _one_line(error)
    logger.warning("the %s cache %s does not read back (%s): computing it again", what, ", ".join(cached), problem)
    for path in cached:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return run_map()


def _read_back(build: Callable[[], object]):
    """(dataset, None) when `build()` reads back with the row count its dataset_info.json records, else (None, what
    is wrong)."""
    try:
        dataset = build()
    except READ_ERRORS as error:
        return None, _one_line(error)
    split = (dataset.info.splits or {}).get("train")
    if split is None or not split.num_examples or split.num_examples == len(dataset):
        return dataset, None
    return None, f"{len(dataset)} rows, not the {split.num_examples} its dataset_info.json records"


def built_dataset(build: Callable[[], object], cache_dir: str, what: str):
    """`build()` (a datasets builder's conversion of a data file into an arrow cache under `cache_dir`, which it
    reuses when it is there); a cache that does not read back, or holds another number of rows than its
    dataset_info.json records, is removed (one warning line naming it) and built again, under a lock beside it
    (the ranks of a node find it damaged together, and one rebuilds it)."""
    if not os.path.isdir(cache_dir) or not os.listdir(cache_dir):  # nothing cached: no error is the cache's
        return build()
    dataset, problem = _read_back(build)
    if problem is None:
        return dataset
    logger.warning("the %s cache %s does not read back (%s): converting it again", what, cache_dir, problem)
    with FileLock(cache_dir.rstrip("/") + ".lock"):
        dataset, problem = _read_back(build)  # another process may have converted it meanwhile
        if problem is None:
            return dataset
        shutil.rmtree(cache_dir, ignore_errors=True)
        return build()
