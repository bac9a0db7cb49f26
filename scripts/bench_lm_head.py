"""The loss over the labelled rows against the loss over every row: the training step's time both ways, in one
process, on a recipe's own packs (the step time before and after trainer/loss.py multiplied only labelled rows).

    python -m scripts.bench_lm_head --config recipes/bench-qwen2_5_vl-3b-shape.yaml [--steps 12] [--warmup 3]
        [--out artifacts/bench-lm-head/<recipe>.json] [dotted.key=value ...]

The recipe's training is built as train.py builds it (trainer/setup.py: its `auto` settings resolved, compiled on
a GPU). Each optimizer step's batches then run twice, one way after the other: with the batch's `label_rows` (what
training does) and with every row of the pack (`step.labelled_rows` replaced within this process: each unlabelled
row adds an exact 0 to the loss and gets a zero gradient, so both compute the same loss; only the lm_head's matmuls
and the softmax over the unlabelled rows differ). Each step is timed between two device syncs; the first `--warmup`
pairs (compile, allocator) are left out. The same batch in both ways makes each pair a like-for-like difference.

The JSON (`--out`): provenance, the recipe and overrides, the mean pack length and labelled share, and per way the
step time (median, min, max) with the ratio of medians; the FLOP model's count for the lm_head both ways
(trainer/metrics.py counts the labelled rows only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from accelerate.state import AcceleratorState

from core.config import load_config
from lifecycle import run_files
from trainer import metrics, step
from trainer.setup import build_accelerator, build_training
from verification.provenance import provenance

WAYS = ("labelled_rows", "every_row")
LABELLED_ROWS = step.labelled_rows  # training's own choice of rows, put back after every step


def every_row(batch: dict) -> torch.Tensor:
    """All rows of the batch's flattened hidden states: the loss over every position, as without label_rows."""
    labels = batch["shift_labels"]
    return torch.arange(labels.numel(), device=labels.device)


def timed_step(setup, accelerator, host_batches: list[dict], way: str, max_grad_norm: float) -> float:
    """One optimizer step over `host_batches` with the loss's rows chosen `way`; its wall time between two syncs."""
    chosen = every_row if way == "every_row" else LABELLED_ROWS
    step.labelled_rows = chosen
    try:
        sync(accelerator.device)
        started = time.perf_counter()
        step.optimizer_step(
            accelerator,
            setup.module,
            setup.optimizer,
            setup.scheduler,
            setup.grad_params,
            host_batches,
            max_grad_norm,
        )
        sync(accelerator.device)
        return time.perf_counter() - started
    finally:
        step.labelled_rows = LABELLED_ROWS


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def lm_head_flops(profile: metrics.FlopProfile, tokens: int, labels: int) -> dict:
    """The lm_head's training FLOPs of a pack counted both ways, by the FLOP model's own per-row rule."""

    def count(rows: int) -> float:
        return metrics.matmul_flops(
            profile.lm_head_params, profile.lm_head_trained_params, profile.llm_input_grads, rows
        )

    return {"labelled_rows": count(labels), "every_row": count(tokens)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/bench-qwen3_5-shape.yaml")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps timed each way")
    parser.add_argument("--warmup", type=int, default=3, help="step pairs left out of the timing (compile)")
    parser.add_argument("--out", default=None, help="JSON path (default: artifacts/bench-lm-head/<recipe>.json)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the recipe")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    overrides = [*args.overrides, "checkpoint.export=false", "logging.report_to=none", "logging.progress_bar=false"]
    cfg = load_config(args.config, overrides)
    accelerator = build_accelerator(cfg)
    try:
        setup = build_training(cfg, accelerator)
        batches = iter(setup.train_loader)
        times = {way: [] for way in WAYS}
        tokens, labels = [], []
        for index in range(args.warmup + args.steps):
            host_batches = [next(batches) for _ in range(cfg.train.grad_accum_steps)]
            order = WAYS if index % 2 == 0 else WAYS[::-1]  # neither way always runs second
            for way in order:
                seconds = timed_step(setup, accelerator, host_batches, way, cfg.train.max_grad_norm)
                if index >= args.warmup:
                    times[way].append(seconds)
            if index >= args.warmup:
                tokens += [b["shift_labels"].numel() for b in host_batches]
                labels += [b["num_label_tokens"] for b in host_batches]
        mean_tokens, mean_labels = statistics.mean(tokens), statistics.mean(labels)
        result = {
            "provenance": provenance(),
            "recipe": args.config,
            "overrides": args.overrides,
            "steps": args.steps,
            "warmup_steps": args.warmup,
            "mean_pack_tokens": mean_tokens,
            "labelled_share": mean_labels / mean_tokens,
            "step_time_s": {way: spread(values) for way, values in times.items()},
            "every_row_over_labelled_rows": statistics.median(times["every_row"])
            / statistics.median(times["labelled_rows"]),
            "lm_head_flops_per_pack": lm_head_flops(setup.flop_profile, round(mean_tokens), round(mean_labels)),
        }
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    out = Path(args.out or f"artifacts/bench-lm-head/{Path(args.config).stem}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    run_files.write_atomically(out, json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "provenance"}, indent=2))
    return result


if __name__ == "__main__":
    main()
