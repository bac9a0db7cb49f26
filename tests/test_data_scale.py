"""The data pipeline at scale: per-record metadata in numpy, plans equal to the frozen ones, the record generator."""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import random
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
from datasets import Dataset, load_from_disk
from filelock import FileLock

from core.config import load_config
from core.config_tree import ConfigError
from core.data_config import DataConfig, PackingConfig
from core.families import hf_config
from data.pipeline import (
    RECORDS_PER_PROCESS,
    DataStats,
    StepLoader,
    build_data,
    in_memory_items,
    load_processor,
    processed_records,
    processing_processes,
    source_build_lock,
    step_vision_kinds,
)
from data.processing import PROCESSED_FEATURES
from verification.bench_data import write_llava_records

ROOT = Path(__file__).resolve().parents[1]

SKIPS = ("missing_image", "corrupt_image", "unknown_format", "empty_text")
PLANNED_ROWS = 3000
HANG_GUARD_S = 120.0  # only a test that hangs waits this long: no outcome depends on how fast the machine is


class SyntheticRows:
    """Stands in for SampleProcessor: row `index` is a processed sample drawn from a generator seeded by the index
    (a skip, a text, image or video sample of 20-1100 tokens), without tokenising anything."""

    def __call__(self, record: dict, index: int) -> dict:
        rng = random.Random(index)
        sample_id = f"row-{index}"
        if rng.random() < 0.03:
            reason = rng.choice(SKIPS)
            return {**EMPTY_ROW, "sample_id": sample_id, "skip_reason": reason, "skip_detail": f"detail {index}"}
        images = [[1, rng.choice((8, 16, 24)), rng.choice((8, 16, 24))] for _ in range(rng.choice((0, 0, 1, 1, 1, 2)))]
        videos = [[rng.randint(1, 4), 8, 12]] if rng.random() < 0.1 else []
        length = 20 + int(1080 * rng.random() ** 3)  # mostly short: packs of several samples
        return {
            **EMPTY_ROW,
            "sample_id": sample_id,
            "input_ids": [7] * length,
            "length": length,
            "image_grid_thw": images,
            "video_grid_thw": videos,
            "num_patches": sum(t * h * w for t, h, w in images + videos),
        }


EMPTY_ROW = {name: [] for name in PROCESSED_FEATURES} | {
    "sample_id": "",
    "skip_reason": "",
    "skip_detail": "",
    "length": 0,
    "num_patches": 0,
    "placeholders_added": False,
}


class CapturedLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def synthetic_plan_source(tmp_path, rows: int = PLANNED_ROWS):
    """(records, processor): `rows` records on disk (memory-mapped, as a cached dataset is) and SyntheticRows."""
    Dataset.from_dict({"record": list(range(rows))}).save_to_disk(str(tmp_path / "records"))
    return load_from_disk(str(tmp_path / "records")), SyntheticRows()


def plan_summary(tmp_path, on_error: str = "skip") -> dict:
    """Everything the plan of SyntheticRows decides, under several layouts: per epoch and layout each step's packs
    (row keys, in order), their vision kinds and the leftover; the eval plan; the data stats."""
    records, processor = synthetic_plan_source(tmp_path)
    data_cfg = DataConfig(seed=3, eval_fraction=0.02, on_error=on_error)
    stats = DataStats()
    logged = CapturedLog()
    logging.getLogger("data.pipeline").addHandler(logged)
    try:
        processed = processed_records(records, processor, "synthetic-plan", num_proc=1)
        train_items, eval_items, _ = in_memory_items(data_cfg, 1024, processed, stats)
    finally:
        logging.getLogger("data.pipeline").removeHandler(logged)
    layouts = {
        "one rank": (PackingConfig(max_tokens=1024, buffer_size=64), 1, 1),
        "two ranks, accumulating": (PackingConfig(max_tokens=1024, buffer_size=48, balance_window_steps=2), 2, 2),
        "three ranks, padded": (PackingConfig(mode="padded", padded_batch_size=5), 3, 1),
    }
    summary = {"stats": [stats.summary(), list(stats.skip_examples.items()), logged.messages]}
    for name, (packing, world_size, accumulation) in layouts.items():
        loader = StepLoader(
            train_items, list, list, packing, 0, world_size, data_cfg.seed, None, grad_accum_steps=accumulation
        )
        for epoch in (0, 1):
            steps = [[[item.key for item in pack.items] for pack in step] for step in loader.steps(epoch)]
            kinds = [step_vision_kinds(step) for step in loader.steps(epoch)]
            summary[f"{name}, epoch {epoch}"] = [steps, kinds, vars(loader.leftover(epoch))]
    evaluation = StepLoader(eval_items, list, list, layouts["one rank"][0], 0, 1, data_cfg.seed, 1)
    summary["eval"] = [[[item.key for item in pack.items] for pack in step] for step in evaluation.steps(0)]
    return summary


# Computed by plan_summary with the pipeline that built a PackItem per row from Python row dicts.
FROZEN_PLAN_DIGESTS = {
    "stats": "6481f67c1ab5e32b282c4201c9f628aa5453961151d23d22c55d0826a2b2c9da",
    "one rank, epoch 0": "09844a442c386677e362f6288457cdcc0a7c83f9b938b41eb8eb90826a6537b1",
    "one rank, epoch 1": "a9a8b8d551a2bf80725f276026cd161dd7d80aec12c8f8da818b79b6fb0ccaf5",
    "two ranks, accumulating, epoch 0": "2f1408999070afd4a2a20e9320097ed24ecbd63a95407c1f5721e2aa87483f27",
    "two ranks, accumulating, epoch 1": "9993b2d7c191943d819ab3b195e0fbc5d2086a14df34b10345a47c917b2f05c7",
    "three ranks, padded, epoch 0": "c9f058eec47fc14d3d7948d875d89b073a92ff9357af82df90f12b745eb54998",
    "three ranks, padded, epoch 1": "fcf66adc49855f479d92979fdda99a323fe8f0b79eacd081950de9b27a13d164",
    "eval": "fc1667b092d7a95d4f9fbea24fab8c69bb7ab9f3343642c2c66902b5dc2f15b7",
}


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def test_plans_equal_the_frozen_plans(tmp_path):
    """The packs, their order per step and rank, the vision kinds, the leftovers, the eval plan and the data stats
    of 3000 synthetic rows equal what the pipeline planned before its per-record metadata moved into numpy (frozen
    digests): a run resumed from an older checkpoint sees the same batches."""
    summary = plan_summary(tmp_path)
    assert summary["stats"][0] == (
        "records=3000 kept_train=2801 kept_eval=57 skipped=142 (unknown_format=17, missing_image=23, "
        "corrupt_image=21, video_too_long=7, empty_text=22, too_long=52)"
    )
    assert {key: digest(value) for key, value in summary.items()} == FROZEN_PLAN_DIGESTS


def test_on_error_raise_names_the_first_bad_row(tmp_path):
    """With data.on_error=raise the plan stops at the first row, in row order, that is skipped or too long, with the
    error the pipeline always gave for it."""
    with pytest.raises(ValueError) as raised:
        plan_summary(tmp_path, on_error="raise")
    assert str(raised.value) == (
        "sample row-12: too_long: 1089 tokens > packing.max_tokens 1024 (data.on_error=skip skips it)"
    )


def test_generated_records_are_reproducible_varied_and_trainable(tmp_path):
    """write_llava_records (scripts/make_llava_records.py) writes the same files for the same arguments; its records
    share the image pool, vary in images (0-2) and turns (1-4), and the pipeline keeps them as samples of widely
    varied length."""
    path = write_llava_records(tmp_path / "a", 120, images=8, seed=1)
    assert write_llava_records(tmp_path / "b", 120, images=8, seed=1).read_bytes() == path.read_bytes()
    assert sorted(p.name for p in (tmp_path / "a" / "images").iterdir()) == [f"pool_{i:05d}.png" for i in range(8)]
    records = [json.loads(line) for line in path.open()]
    images = [record.get("image", []) for record in records]
    assert len(records) == 120 and {len(i) if isinstance(i, list) else int(bool(i)) for i in images} == {0, 1, 2}
    assert {len(record["conversations"]) // 2 for record in records} == {1, 2, 3, 4}
    overrides = [f"data.path={path}", "data.eval_fraction=0", "data.num_workers=0", f"data.cache_dir={tmp_path}"]
    cfg = load_config("recipes/tiny-qwen2_5_vl.yaml", overrides)
    train, _, stats = build_data(cfg.data, cfg.packing, load_processor(cfg.model, cfg.data), hf_config(cfg.model))
    assert stats.kept_train + stats.skipped["too_long"] == 120 and stats.kept_train > 110
    lengths = [item.length for item in train.items(0)]
    assert min(lengths) < 100 and max(lengths) > 600


def large_containers(root, at_least: int) -> list[str]:
    """Type names of the lists, tuples, dicts and sets of `at_least` or more entries reachable from `root`'s Python
    objects (not through modules, classes or functions), e.g. a Python object per record."""
    found, seen, stack = [], set(), [root]
    while stack:
        value = stack.pop()
        if id(value) in seen or isinstance(value, type | types.ModuleType | types.FunctionType):
            continue
        seen.add(id(value))
        if isinstance(value, list | tuple | dict | set) and len(value) >= at_least:
            found.append(type(value).__name__)
        stack.extend(gc.get_referents(value))
    return found


def test_the_plan_holds_numpy_arrays_not_a_python_object_per_row(tmp_path):
    """The in-memory loaders keep their per-row metadata (lengths, patches, kinds, split indices) in numpy arrays
    and reach no Python container with an entry per row: the cost of a million rows is a few arrays, not millions
    of objects."""
    records, processor = synthetic_plan_source(tmp_path)
    processed = processed_records(records, processor, "synthetic-plan", num_proc=1)
    train_items, eval_items, fetch = in_memory_items(DataConfig(), 1024, processed, DataStats())
    rows = train_items.rows
    assert rows is eval_items.rows
    assert [(a.dtype, a.shape) for a in (rows.lengths, rows.patches, rows.kinds, rows.skipped)] == [
        (np.int32, (PLANNED_ROWS,)),
        (np.int32, (PLANNED_ROWS,)),
        (np.bool_, (PLANNED_ROWS, 2)),
        (np.bool_, (PLANNED_ROWS,)),
    ]
    assert train_items.indices.dtype == np.int64 and len(train_items.indices) > PLANNED_ROWS // 2
    loader = StepLoader(train_items, fetch, list, PackingConfig(max_tokens=1024), 0, 1, 0, None)
    assert large_containers(loader, at_least=PLANNED_ROWS // 10) == []


def test_a_cached_start_reads_no_record(tmp_path, monkeypatch):
    """A second build of the same data parses no record: neither processing nor the listing of the image files the
    records reference runs again (both come from the cache), and each distinct file is statted once per start."""
    from data import image_files, processing

    path = write_llava_records(tmp_path / "data", 60, images=4, seed=2)
    calls = {"process": 0, "image_files": 0, "stat": []}
    process, listing = processing.SampleProcessor.process, processing.SampleProcessor.image_files
    file_state = image_files.file_state

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(processing.SampleProcessor, "process", counted("process", process))
    monkeypatch.setattr(processing.SampleProcessor, "image_files", counted("image_files", listing))
    monkeypatch.setattr(image_files, "file_state", lambda path: calls["stat"].append(path) or file_state(path))
    overrides = [f"data.path={path}", "data.num_workers=0", f"data.cache_dir={tmp_path / 'cache'}"]
    cfg = load_config("recipes/tiny-qwen2_5_vl.yaml", overrides)
    processor, model_config = load_processor(cfg.model, cfg.data), hf_config(cfg.model)
    first = build_data(cfg.data, cfg.packing, processor, model_config)[2]
    assert (calls["process"], calls["image_files"]) == (60, 60) and first.kept_train > 0
    calls.update(process=0, image_files=0, stat=[])
    cached = build_data(cfg.data, cfg.packing, processor, model_config)[2]
    assert (calls["process"], calls["image_files"]) == (0, 0) and cached == first
    assert sorted(calls["stat"]) == sorted(str(p).encode() for p in (tmp_path / "data" / "images").iterdir())


def test_num_proc_defaults_to_the_cores_this_process_may_use(monkeypatch):
    """data.num_proc: null (the default) processes on every core of this process's CPU affinity, one process per
    RECORDS_PER_PROCESS records at most (fewer records and a process costs more than it saves); a number is used as
    given; 0 is a config error."""
    assert DataConfig().num_proc is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    assert processing_processes(None, 1_000_000) == 6
    assert processing_processes(None, 3 * RECORDS_PER_PROCESS) == 3
    assert processing_processes(None, 10) == 1
    assert processing_processes(2, 10) == 2
    with pytest.raises(ConfigError, match=r"data\.num_proc must be >= 1 or null"):
        load_config("recipes/smoke.yaml", ["data.num_proc=0"])


def test_one_process_at_a_time_builds_a_source(tmp_path, caplog):
    """While one process holds a source's build lock (another rank processing it), a second waits, says so in the
    log, and goes on once the first is done (it then finds the cache the first wrote)."""
    held = FileLock(tmp_path / "locks" / "processing-source.lock")
    (tmp_path / "locks").mkdir()
    held.acquire()
    entered, waiting = threading.Event(), threading.Event()

    class OnWaiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for another process to finish processing this data" in record.getMessage():
                waiting.set()

    def build():
        with source_build_lock(str(tmp_path), "source"):
            entered.set()

    logger, on_waiting = logging.getLogger("data.pipeline"), OnWaiting()
    with caplog.at_level(logging.INFO, logger="data.pipeline"):
        logger.addHandler(on_waiting)
        try:
            waiter = threading.Thread(target=build)
            waiter.start()
            assert waiting.wait(HANG_GUARD_S), "the second builder never said it waits"
            assert not entered.is_set()  # it says so while it waits, before it holds the lock
            held.release()
            waiter.join(HANG_GUARD_S)
        finally:
            logger.removeHandler(on_waiting)
    assert entered.is_set()


MEMORY_PROBE = """
import resource, sys
from core.families import hf_config
from data.pipeline import build_data, load_processor
from verification.plan_totals import epoch_totals
from core.config import load_config

if __name__ == "__main__":
    cfg = load_config("recipes/tiny-qwen2_5_vl.yaml", sys.argv[1:])
    train, _, _ = build_data(cfg.data, cfg.packing, load_processor(cfg.model, cfg.data), hf_config(cfg.model))
    assert epoch_totals(train)["packs"] > 0  # inspect_data's walk over the epoch
    batches = iter(train)
    for _ in range(3):
        next(batches)
    train.leftover(1)  # the loader's walk over a whole epoch's plan
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


@pytest.mark.slow
def test_memory_stays_flat_with_the_record_count(tmp_path):
    """A cached start's peak RSS, with inspect_data's walk over an epoch, a few training batches and the plan of a
    whole epoch, grows by less than 1 KiB per record from 2,000 to 20,000 records (Python objects per record would
    cost several KiB each)."""
    peaks = {}
    for records in (2_000, 20_000):
        path = write_llava_records(tmp_path / f"data-{records}", records, images=16)
        overrides = [f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}", "data.num_workers=0"]
        command = [sys.executable, "-c", MEMORY_PROBE, *overrides]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)  # the first build
        peaks[records] = int(subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True).stdout)
    assert (peaks[20_000] - peaks[2_000]) / 18_000 < 1024, peaks
