"""The data pipeline measured at scale (scripts/measure_data_scale.py; docs/data-scale.md): a command's wall time,
CPU time (user + system of its process tree: on a shared machine, what the command itself costs, which the wall
time shows only when the cores are idle) and peak memory sampled while it runs; the measured data (one source or
a mixture's sources), and the repeated-records data whose processed cache is built once per distinct record, so a
busy machine still measures the cached start at a large record count.
"""

from __future__ import annotations

import os
import resource
import subprocess
import time
from pathlib import Path

import psutil

from data.processing import RECORD_JSON_COLUMN, SampleProcessor
from verification.bench_data import write_llava_records

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny-qwen2_5_vl.yaml"  # the recipe whose data is measured
SAMPLE_S = 0.5  # memory sampling interval
GIB = 2**30
MIXTURE_WEIGHTS = (0.5, 0.3, 0.2, 0.1)  # a measured mixture of S sources weighs them by the first S


def _tree_pss(process: psutil.Process) -> int:
    """Summed PSS of `process` and its descendants (bytes); a process that ended meanwhile counts 0."""
    total = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            total += member.memory_full_info().pss
        except psutil.Error:
            continue
    return total


def _children_cpu_s() -> float:
    """User + system seconds of this process's finished (and waited-for) descendants so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_measured(command: list[str], log: Path) -> dict:
    """Run `command` from the repository root, its output into `log`; {wall_s, cpu_s, peak_rss_gib (main process),
    peak_tree_pss_gib, load_before, load_after}. Raises when it fails."""
    load_before = os.getloadavg()
    cpu_before = _children_cpu_s()
    started = time.perf_counter()
    with log.open("w") as out:
        child = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        process = psutil.Process(child.pid)
        peak_rss = peak_pss = 0
        while child.poll() is None:
            try:
                peak_rss = max(peak_rss, process.memory_info().rss)
                peak_pss = max(peak_pss, _tree_pss(process))
            except psutil.Error:
                pass
            time.sleep(SAMPLE_S)
    wall = time.perf_counter() - started
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({child.returncode}); see {log}")
    return {
        "wall_s": round(wall, 1),
        "cpu_s": round(_children_cpu_s() - cpu_before, 1),
        "peak_rss_gib": round(peak_rss / GIB, 3),
        "peak_tree_pss_gib": round(peak_pss / GIB, 3),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }


class _ProcessedOnce(SampleProcessor):
    """A SampleProcessor that processes each distinct JSON line once and returns the same row for its repeats."""

    def __call__(self, record, index: int) -> dict:
        rows = self.__dict__.setdefault("_rows", {})
        key = record.get(RECORD_JSON_COLUMN)
        if key not in rows:
            rows[key] = super().__call__(record, index)
        return rows[key]


def prebuild(overrides: list[str]) -> None:
    """Write the processed cache of the recipe with `overrides` as build_data would, each distinct record processed
    once (one process: the rows of the distinct records are held in memory)."""
    from core.config import load_config
    from core.families import hf_config
    from data import pipeline

    cfg = load_config(RECIPE, [*overrides, "data.num_proc=1"])
    pipeline.SampleProcessor = _ProcessedOnce
    pipeline.build_data(cfg.data, cfg.packing, pipeline.load_processor(cfg.model, cfg.data), hf_config(cfg.model))


def repeated_records(records: int, source: Path, data: Path) -> None:
    """`data`/data.jsonl: the lines of `source`/data.jsonl repeated up to `records` lines; `data`/images: source's."""
    data.mkdir(parents=True, exist_ok=True)
    if not (data / "images").exists():
        (data / "images").symlink_to(source / "images")
    lines = (source / "data.jsonl").read_text().splitlines(keepends=True)
    with (data / "data.jsonl").open("w") as out:
        for start in range(0, records, len(lines)):
            out.writelines(lines[: records - start])


def _records_dir(work: Path, count: int, seed: int) -> Path:
    return work / (f"llava-{count}" if seed == 0 else f"llava-{count}-seed{seed}")


def source_data(work: Path, count: int, seed: int, repeat: int | None) -> Path:
    """The data.jsonl of `count` records written with `seed` (with `repeat` < count: `repeat` of them repeated),
    written under `work` unless there already."""
    data = _records_dir(work, count, seed)
    if repeat:
        data = data.with_name(f"{_records_dir(work, repeat, seed).name}-repeated-{count}")
    if not (data / "data.jsonl").exists():
        if repeat:
            base = _records_dir(work, repeat, seed)
            if not (base / "data.jsonl").exists():
                write_llava_records(base, repeat, seed=seed)
            repeated_records(count, base, data)
        else:
            write_llava_records(data, count, seed=seed)
    return data / "data.jsonl"


def data_overrides(records: int, work: Path, repeat: int | None, sources: int) -> list[str]:
    """data.path of one source, or data.sources of `sources` (records split evenly, weights MIXTURE_WEIGHTS)."""
    if sources == 1:
        repeat = repeat if repeat is not None and records > repeat else None
        return [f"data.path={source_data(work, records, 0, repeat)}"]
    entries = []
    for index in range(sources):
        count = records // sources + (index < records % sources)
        source_repeat = repeat if repeat is not None and count > repeat else None
        path = source_data(work, count, index, source_repeat)
        entries.append(f"{{path: {path}, weight: {MIXTURE_WEIGHTS[index]}}}")
    return ["data.path=null", f"data.sources=[{', '.join(entries)}]"]
