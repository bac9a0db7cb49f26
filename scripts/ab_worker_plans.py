"""What planning the vision tower's grids in the loader workers saves, timed in one process.

    python -m scripts.ab_worker_plans --config recipes/bench-qwen2_5_vl-3b-shape.yaml [--rounds 4] \
        [--block 5] [--warmup 5] [dotted.key=value ...]

train.py's steps (training/setup.py's build_training, training/loop.py's Steps) in blocks of `--block` optimizer
steps, the device synchronised before and after each block as train.py's log intervals do. Each round runs one
block whose batches carry the loader workers' vision plans (`vision_host_plans`, what train.py does) and one whose
batches have them taken out, so the step plans its grids itself (what it did before); the order alternates (ABBA),
so neither mode always follows the other. One process, one model, one compile: the difference between the modes is
the planning alone, not another machine or another launch. Prints ms per step per block and each mode's median, and
writes them as JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from training import loop, vision_plan
from training.config import load_config
from training.setup import build_accelerator, build_training

MODES = ("worker plans", "step plans")


class PlanToggle:
    """The prefetched batches, with their worker plans taken out while `drop` is set."""

    def __init__(self, batches):
        self.batches = batches
        self.drop = False

    def __next__(self) -> dict:
        batch = next(self.batches)
        if self.drop:
            batch = {key: value for key, value in batch.items() if key != vision_plan.HOST_PLANS}
        return batch

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def close(self) -> None:
        self.batches.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of one block per mode")
    parser.add_argument("--block", type=int, default=5, help="optimizer steps per block (train.py logs every 5)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile, allocator growth)")
    parser.add_argument("--out", default=None, help="JSON file for the per-block times")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    if min(args.rounds, args.block) < 1 or args.warmup < 0:
        parser.error("--rounds and --block must be at least 1, --warmup 0 or more")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    accelerator = build_accelerator(cfg)
    setup = build_training(cfg, accelerator)
    device = accelerator.device

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    steps = loop.Steps(accelerator, setup, cfg.train)
    toggle = steps.batches = PlanToggle(steps.batches)
    blocks: list[dict] = []
    try:
        for _ in range(args.warmup):
            steps.run()
        for round_index in range(args.rounds):
            order = MODES if round_index % 2 == 0 else MODES[::-1]
            for mode in order:
                toggle.drop = mode == "step plans"
                sync()
                started = time.perf_counter()
                for _ in range(args.block):
                    steps.run()
                sync()
                blocks.append(
                    {
                        "round": round_index,
                        "mode": mode,
                        "ms_per_step": 1e3 * (time.perf_counter() - started) / args.block,
                    }
                )
                print(f"[ab] round {round_index} {mode}: {blocks[-1]['ms_per_step']:.1f} ms/step", flush=True)
    finally:
        steps.close()
    medians = {mode: statistics.median(b["ms_per_step"] for b in blocks if b["mode"] == mode) for mode in MODES}
    report = {
        "config": args.config,
        "overrides": args.overrides,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "block_steps": args.block,
        "blocks": blocks,
        "median_ms_per_step": medians,
        "step_plans_over_worker_plans": medians["step plans"] / medians["worker plans"],
    }
    print(json.dumps({k: report[k] for k in ("median_ms_per_step", "step_plans_over_worker_plans")}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
