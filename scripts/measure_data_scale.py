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

from scripts.make_llava_records import write_llava_records
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


def measure(records: int, work: Path, extra: list[str]) -> dict:
    """The three commands of the module docstring for `records` records; their measurements and command lines."""
    data = work / f"llava-{records}"
    if not (data / "data.jsonl").exists():
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
    result = {"records": records}
    for name, command, pattern in (
        ("first_build", inspect, BUILT),
        ("cached_inspect", inspect, BUILT),
        ("cached_train", train, READY),
    ):
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
        result["runs"].append(measure(records, work, args.overrides))
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")  # what is measured so far survives a kill
    print(Path(args.out).resolve())


if __name__ == "__main__":
    main()
