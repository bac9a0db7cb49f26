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
For each: wall seconds, CPU seconds (user + system of the command's process tree), the build time the command
logs, and peak memory sampled every SAMPLE_S (verification/data_scale.py): the main process's RSS (what
`/usr/bin/time -v` reports) and the whole process tree's PSS (loader workers and their server included, shared
pages counted once).

`--repeat R`: a count above R is measured on R's records repeated (the JSONL's lines over and over), whose
processed cache `prebuild` writes by processing each distinct record once (its rows are exactly those of a full
first build, which processes every line alike), so a machine too busy for a full first build still measures the
cached start and memory at that size; its first build is then not measured (null).

`--sources S` (default 1): the N records are S sources of a weighted mixture (`data.sources`, weights
MIXTURE_WEIGHTS), N/S records each, source i written with seed i (so the sources differ); with `--repeat R`, each
source over R is its own R records repeated.
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

from verification.data_scale import GIB, MIXTURE_WEIGHTS, RECIPE, data_overrides, run_measured
from verification.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
BUILT = re.compile(r"built in ([\d.]+)s")  # inspect_data's build_data time
READY = re.compile(r"data: .* \(ready in ([\d.]+) s\)")  # the pipeline's log line in train.py


def _logged_seconds(pattern: re.Pattern, log: Path) -> float | None:
    match = pattern.search(log.read_text(errors="replace"))
    return float(match.group(1)) if match else None


def measure(records: int, work: Path, extra: list[str], repeat: int | None = None, sources: int = 1) -> dict:
    """The three commands of the module docstring for `records` records (in `sources` sources); their measurements
    and command lines. With `repeat` (< records): the records of `repeat` repeated, the cache prebuilt, the first
    build not measured."""
    tag = f"{records}" if sources == 1 else f"{records}-{sources}sources"
    cache = work / f"cache-{tag}"
    shutil.rmtree(cache, ignore_errors=True)
    common = [*data_overrides(records, work, repeat, sources), f"data.cache_dir={cache}", *extra]
    inspect = [sys.executable, "-m", "scripts.inspect_data", "--config", RECIPE, *common]
    run_dir = work / f"run-{tag}"
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
    result = {"records": records, "sources": sources, "repeated_from": repeat}
    commands = [("first_build", inspect, BUILT), ("cached_inspect", inspect, BUILT), ("cached_train", train, READY)]
    if repeat:
        prebuild = "import sys; from verification.data_scale import prebuild; prebuild(sys.argv[1:])"
        command = [sys.executable, "-c", prebuild]
        started = time.perf_counter()
        subprocess.run([*command, *common], cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result["prebuild_s"] = round(time.perf_counter() - started, 1)
        result["first_build"], commands = None, commands[1:]
    for name, command, pattern in commands:
        log = work / f"{name}-{tag}.log"
        result[name] = run_measured(command, log) | {
            "data_s": _logged_seconds(pattern, log),
            "command": " ".join(command).replace(sys.executable, "python"),
        }
        print(f"[data-scale] {records} records ({sources} sources), {name}: {json.dumps(result[name])}", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, nargs="+", required=True, help="record counts to measure")
    parser.add_argument("--work", required=True, help="directory for the data, caches, runs and logs")
    parser.add_argument("--out", required=True, help="result JSON")
    parser.add_argument("--repeat", type=int, help="measure larger counts on this count's records repeated")
    parser.add_argument(
        "--sources", type=int, default=1, choices=range(1, len(MIXTURE_WEIGHTS) + 1), help="sources of a mixture"
    )
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
        result["runs"].append(measure(records, work, args.overrides, repeat, args.sources))
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")  # what is measured so far survives a kill
    print(Path(args.out).resolve())


if __name__ == "__main__":
    main()
