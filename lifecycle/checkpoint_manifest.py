"""What a checkpoint's COMPLETE marker vouches for, and the check of it before a resume trusts the checkpoint.

The marker is JSON: the step, the number of processes that saved it, and every file of the checkpoint with its size
and its xxh3-128 checksum (`checkpoint.checksums`, on by default):

    {"step": 100, "num_processes": 16, "files": {"model.safetensors": {"bytes": 1234, "xxh3_128": "9f…"}, …}}

A copy cut short between filesystems, a bad disk or a file replaced after the save no longer matches it. The
ranks share the work, writing and checking alike: the files are dealt to them by size and each hashes its share.
xxh3-128 hashes several times faster than sha256 and keeps up with reading a checkpoint from disk (docs/cluster.md
has the measurements and what they mean for a 7B model's ~100 GB of state). It detects damage, not tampering: for
that use a cryptographic hash outside the trainer.

A marker of plain text (the step only: checkpoints saved before the marker recorded files) vouches for nothing
checkable; such a checkpoint is trusted as written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import xxhash

CHECKSUM = "xxh3_128"
READ_CHUNK = 8 << 20  # bytes per read while hashing: large reads, bounded memory


@dataclass(frozen=True)
class Manifest:
    """A COMPLETE marker's record: `files` maps each path (relative to the checkpoint) to {"bytes", CHECKSUM?}."""

    step: int
    num_processes: int | None  # None: a plain-text marker, which did not record it
    files: dict[str, dict] | None  # None: a plain-text marker, which vouches for no file
    readable: bool = True  # False: the marker itself is damaged (cut short, overwritten), so it vouches for nothing


def file_checksum(path: Path) -> str:
    """The xxh3-128 hex digest of the file at `path`."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            digest.update(view[:read])
    return digest.hexdigest()


def checkpoint_files(directory: Path, marker: str) -> dict[str, int]:
    """{relative path: bytes} of every file under `directory` but the marker, in path order."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != marker)
    return {str(p.relative_to(directory)): p.stat().st_size for p in files}


def share(sizes: dict[str, int], rank: int, world_size: int) -> list[str]:
    """The paths of `sizes` that `rank` handles: largest first to the least-loaded rank, so every rank reads about
    as many bytes (the same deal on every rank for the same `sizes`)."""
    loads = [0] * world_size
    mine = []
    for path in sorted(sizes, key=lambda p: (-sizes[p], p)):
        target = min(range(world_size), key=lambda r: (loads[r], r))
        loads[target] += sizes[path]
        if target == rank:
            mine.append(path)
    return mine


def describe(directory: Path, paths: list[str], checksums: bool) -> dict[str, dict]:
    """The manifest entries of `paths` (relative to `directory`): size, and checksum when `checksums`."""
    entries = {}
    for path in paths:
        file = directory / path
        entries[path] = {"bytes": file.stat().st_size}
        if checksums:
            entries[path][CHECKSUM] = file_checksum(file)
    return entries


def render(step: int, num_processes: int, files: dict[str, dict]) -> str:
    return json.dumps({"step": step, "num_processes": num_processes, "files": dict(sorted(files.items()))}) + "\n"


def read(marker: Path) -> Manifest:
    """The marker's record; a plain-text marker (just the step) gives a Manifest without files, and anything else
    (a record cut short, other bytes) an unreadable one."""
    text = marker.read_text(errors="replace")
    if text.strip().isdigit():
        return Manifest(int(text), None, None)
    try:
        record = json.loads(text)
        files = record["files"]
        sizes_recorded = all(isinstance(entry.get("bytes"), int) for entry in files.values())
        if sizes_recorded:
            return Manifest(int(record["step"]), int(record["num_processes"]), files)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError):
        pass
    return Manifest(-1, None, None, readable=False)


def damage(directory: Path, manifest: Manifest, paths: list[str]) -> list[str]:
    """How the files `paths` of `directory` differ from `manifest`: one short phrase per damaged file."""
    problems = []
    for path in paths:
        entry, file = manifest.files[path], directory / path
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path} is missing")
            continue
        if size != entry["bytes"]:
            problems.append(f"{path} has {size} bytes, {entry['bytes']} recorded")
        elif CHECKSUM in entry and file_checksum(file) != entry[CHECKSUM]:
            problems.append(f"{path} has another {CHECKSUM} checksum than recorded")
    return problems
