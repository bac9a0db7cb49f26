"""Measure the data pipeline at scale: first build, cached start and peak memory of inspect_data and train.py.

    python -m scripts.measure_data_scale --records 50000 200000 1000000 --work /tmp/data-scale \
        --out docs/results/data-scale-<date>.json

Per record count N: scripts/make_llava_records.py writes N records over 64 images (once, under --work), then three
commands run one after another, each alone (their wall time and memory are this machine's, under whatever else
runs on it: the load average before and after each is recorded):
  first build   `python -m scripts.inspect_data` on an empty cache (the processing, then the summary)
  cached        the same command again (the processed dataset from the cache)
  train start   `python train.py ... train.max_steps=1` from the cache: the whole run (model, data, one step, the
                checkpoint and export)
For each: wall seconds, the build time the command logs, and peak memory sampled every SAMPLE_S: the main
process's RSS (what `/usr/bin/time -v` reports) and the whole process tree's PSS (loader workers and their server
included, shared pages counted once).

`--repeat R`: a count above R is measured on R's records repeated (the JSONL's lines over and over), whose
processed cache `prebuild` writes by processing each distinct record once (its rows are exactly those of a full
first build, which processes every line alike), so a machine too busy for a full first build still measures the
cached start and memory at that size; its first build is then not measured (null).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

from data.processing import RECORD_JSON_COLUMN, SampleProcessor
from verification.bench_data import write_llava_records
from verification.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny-qwen2_5_vl.yaml"
SAMPLE_S = 0.5
GIB = 2**30
BUILT = re.compile(r"built in ([\d.]+)s")  # inspect_data's build_data time
READY = re.compile(r"data: .* \(ready in ([\d.]+) s\)")  # the pipeline's log line in train.py


def _tree_pss(process: psutil.Process) -> int:
    """Summed PSS of `process` and its descendants (bytes); a process that ended meanwhile counts 0."""
    total = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            total += member.memory_full_info().pss
        except psutil.Error:
            continue
    return total


def run_measured(command: list[str], log: Path) -> dict:
    """Run `command` from the repository root, its output into `log`; {wall_s, peak_rss_gib (main process),
    peak_tree_pss_gib, load_before, load_after, exit_code}. Raises when it fails."""
    load_before = os.getloadavg()
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
        "peak_rss_gib": round(peak_rss / GIB, 3),
        "peak_tree_pss_gib": round(peak_pss / GIB, 3),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }


def _logged_seconds(pattern: re.Pattern, log: Path) -> float | None:
    match = pattern.search(log.read_text(errors="replace"))
    return float(match.group(1)) if match else None


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


def measure(records: int, work: Path, extra: list[str], repeat: int | None = None) -> dict:
    """The three commands of the module docstring for `records` records; their measurements and command lines.
    With `repeat` (< records): the records of `repeat` repeated, the cache prebuilt, the first build not measured."""
    data = work / (f"llava-{repeat}-repeated-{records}" if repeat else f"llava-{records}")
    if not (data / "data.jsonl").exists():
        if repeat:
            repeated_records(records, work / f"llava-{repeat}", data)
        else:
            write_llava_records(data, records)
    cache = work / f"cache-{records}"
    shutil.rmtree(cache, ignore_errors=True)
    common = [f"data.path={data / 'data.jsonl'}", f"data.cache_dir={cache}", *extra]
    inspect = [sys.executable, "-m", "scripts.inspect_data", "--config", RECIPE, *common]
    run_dir = work / f"run-{records}"
    shutil.rmtree(run_dir, ignore_errors=True)
    train = [
        sys.executable,
        "train.py",
        "--config",
        RECIPE,
        *common,
        "train.max_steps=1",
        f"train.output_dir={run_dir}",
    ]
    result = {"records": records, "repeated_from": repeat}
    commands = [("first_build", inspect, BUILT), ("cached_inspect", inspect, BUILT), ("cached_train", train, READY)]
    if repeat:
        command = [sys.executable, "-c", f"import sys; from {__spec__.name} import prebuild; prebuild(sys.argv[1:])"]
        started = time.perf_counter()
        subprocess.run([*command, *common], cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result["prebuild_s"] = round(time.perf_counter() - started, 1)
        result["first_build"], commands = None, commands[1:]
    for name, command, pattern in commands:
        log = work / f"{name}-{records}.log"
        result[name] = run_measured(command, log) | {
            "data_s": _logged_seconds(pattern, log),
            "command": " ".join(command).replace(sys.executable, "python"),
        }
        print(f"[data-scale] {records} records, {name}: {json.dumps(result[name])}", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, nargs="+", required=True, help="record counts to measure")
    parser.add_argument("--work", required=True, help="directory for the data, caches, runs and logs")
    parser.add_argument("--out", required=True, help="result JSON")
    parser.add_argument("--repeat", type=int, help="measure larger counts on this count's records repeated")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every command")
    args = parser.parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    machine = {
        "cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
    }
    result = {"provenance": provenance(), "machine": machine, "recipe": RECIPE, "runs": []}
    for records in args.records:
        repeat = args.repeat if args.repeat is not None and records > args.repeat else None
        result["runs"].append(measure(records, work, args.overrides, repeat))
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")  # what is measured so far survives a kill
    print(Path(args.out).resolve())


if __name__ == "__main__":
    main()
