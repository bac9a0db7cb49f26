"""The image, video and frame files the records reference, and their signature: part of the processed cache's key,
so an image deleted, added or rewritten after processing never leaves a stale skip or row behind.

Which files a record references follows from the record alone, so the list is computed once per version of the
records (a `datasets.map` cached next to them, like the processed dataset) and a cached start reads one arrow
column instead of parsing every record again. The files themselves can change at any time, so each start stats
every distinct file once, from a few threads (a network file system answers a stat in a fraction of a
millisecond; many in flight keep a large image pool from costing minutes).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pyarrow.compute as pc
from datasets import Dataset, Features, List, Value

from core.caches import mapped
from data.processing import SampleProcessor

FILES_COLUMN = "__image_files__"
LISTING_VERSION = 2  # bump when what `SampleProcessor.image_files` returns changes, to list the records again
STAT_THREADS = 16
PATHS_PER_READ = 4096  # distinct paths turned into Python strings at once
LISTING_BATCH = 1000  # records per call of the listing map


class _FilesOf:
    """`datasets.map(batched=True)` function: each record's referenced files, as UTF-8 bytes (surrogates kept,
    since a JSON path may hold them and arrow strings cannot)."""

    def __init__(self, sample_processor: SampleProcessor):
        self.sample_processor = sample_processor

    def __call__(self, batch: dict) -> dict:
        records = (dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True))
        files = [self.sample_processor.image_files(record) for record in records]
        return {FILES_COLUMN: [[path.encode("utf-8", "surrogatepass") for path in paths] for paths in files]}


def list_files(records: Dataset, sample_processor: SampleProcessor, num_proc: int) -> Dataset:
    """One row per record: FILES_COLUMN, the files it references (bytes), cached per version of the records,
    their image root and format."""
    key = [records._fingerprint, sample_processor.image_root, sample_processor.data_format, LISTING_VERSION]
    fingerprint = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
    run_map = functools.partial(
        records.map,
        _FilesOf(sample_processor),
        batched=True,
        batch_size=LISTING_BATCH,
        remove_columns=records.column_names,
        features=Features({FILES_COLUMN: List(Value("binary"))}),
        num_proc=num_proc if num_proc > 1 else None,
        new_fingerprint=fingerprint,
        desc="listing image files",
    )
    return mapped(records, fingerprint, run_map, "image-file listing")


def file_state(path: bytes) -> bytes:
    """The path with its size and mtime (ns), or marked missing (also a name no file can have)."""
    try:
        stat = os.stat(path.decode("utf-8", "surrogatepass"))
    except (OSError, ValueError):
        return path + b"\0missing\n"
    return path + f"\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode()


def files_signature(listing: Dataset) -> str:
    """Hash of (path, size, mtime_ns) of every distinct file in `listing` (list_files), in path order."""
    paths = pc.unique(pc.list_flatten(listing.data.table.column(FILES_COLUMN)))
    paths = paths.take(pc.array_sort_indices(paths))
    digest = hashlib.blake2b(digest_size=16)
    with ThreadPoolExecutor(STAT_THREADS) as pool:
        for start in range(0, len(paths), PATHS_PER_READ):
            for state in pool.map(file_state, paths[start : start + PATHS_PER_READ].to_pylist()):
                digest.update(state)
    return digest.hexdigest()
