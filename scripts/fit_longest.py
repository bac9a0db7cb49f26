"""The longest single sample a layout trains, from short probe runs instead of a sweep to out-of-memory.

With activation checkpointing, a step's peak memory is the model's states (a constant) plus activations that grow
linearly with the sample's tokens (the varlen attention keeps no T x T matrix). So two or more probe runs of
one-sample packs (`scripts/make_long_samples.py`, `packing.max_tokens` = 2 x words + 512, `train.max_steps=2`: the
second step is the first with AdamW's states) fit peak = a + b * tokens per GPU-layout, and the longest sample that
fits is (memory - a) / b. A sweep to out-of-memory costs quadratic attention time per try (a 350k-token sample of the
3B shape takes ~2 minutes per step on one H200); the probes cost seconds, and the residuals show whether the line
holds.

    python -m scripts.fit_longest --memory-gib 137 runs/probe-cp1-* [--json out.json]

Each run directory's last training record gives the step's tokens (tokens/s per GPU x step time x processes: the
pack's tokens, counted once under context parallelism) and the run's peak memory (GiB allocated, rank 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from training import run_files


def probe_point(run_dir: Path) -> tuple[float, float]:
    """(tokens of the run's last step, the run's peak GiB) from its metrics.jsonl and summary.json."""
    record = run_files.training_records(run_dir)[-1]
    processes = run_files.read_summary(run_dir)["num_processes"]
    tokens = record["tokens_per_s_per_gpu"] * record["step_time_s"] * processes
    return tokens, record["peak_mem_gib"]


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares peak = intercept + slope * tokens; returns (intercept GiB, slope GiB per token, largest
    |residual| GiB)."""
    if len({tokens for tokens, _ in points}) < 2:
        raise ValueError("need probe runs at two or more different sample lengths.")
    tokens, peaks = np.array(points).T
    slope, intercept = np.polyfit(tokens, peaks, 1)
    residual = float(np.abs(peaks - (intercept + slope * tokens)).max())
    return float(intercept), float(slope), residual


def longest_tokens(intercept: float, slope: float, memory_gib: float) -> float:
    """Tokens at which the fitted peak reaches `memory_gib`."""
    if slope <= 0:
        raise ValueError(f"peak memory does not grow with the sample (slope {slope:.3g} GiB/token): no limit to fit.")
    return (memory_gib - intercept) / slope


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="probe run directories (train.output_dir)")
    parser.add_argument("--memory-gib", type=float, required=True, help="allocatable GPU memory to fill, GiB")
    parser.add_argument("--json", type=Path, help="also write the points and the fit here")
    args = parser.parse_args(argv)
    points = [probe_point(run) for run in args.runs]
    intercept, slope, residual = fit_line(points)
    longest = longest_tokens(intercept, slope, args.memory_gib)
    for run, (tokens, peak) in zip(args.runs, points, strict=True):
        print(f"{run}: {tokens:,.0f} tokens, peak {peak:.2f} GiB")
    print(f"peak = {intercept:.2f} GiB + {slope * 1e3:.4f} GiB per 1k tokens (largest residual {residual:.2f} GiB)")
    print(f"longest sample within {args.memory_gib:g} GiB: {longest:,.0f} tokens")
    if args.json:
        result = {
            "points": [{"run": str(run), "tokens": t, "peak_gib": p} for run, (t, p) in zip(args.runs, points)],
            "intercept_gib": intercept,
            "gib_per_token": slope,
            "largest_residual_gib": residual,
            "memory_gib": args.memory_gib,
            "longest_tokens": longest,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
