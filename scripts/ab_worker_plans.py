"""What planning the vision tower's grids in the loader workers saves, timed by train.py itself in one run.

    python -m scripts.ab_worker_plans --config recipes/bench-qwen2_5_vl-3b-shape.yaml --out DIR [--rounds 2] \
        [--block 5] [--warmup 5] [dotted.key=value ...]

One train.py run (its loop, metrics and log syncs) of `warmup + rounds · 2 · block` optimizer steps, logging every
`block` steps, so each log interval is one block. After the warm-up, each round runs one block whose batches carry
the loader workers' vision plans (`vision_host_plans`: what train.py does) and one whose batches have them taken
out, so the step plans its grids itself (what it did before); the order alternates (ABBA), so neither mode always
follows the other. One process, one model, one compile: the difference between the modes is the planning alone,
not another machine or another launch. Reads each interval's step time from the run's metrics.jsonl; prints them
and each mode's median, and writes them to DIR/ab.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import train
from training import loop, vision_plan

MODES = ("worker plans", "step plans")


def block_mode(step: int, warmup: int, block: int) -> str | None:
    """The mode of optimizer step `step` (1-based): None in the warm-up, then blocks of `block` steps in ABBA order."""
    if step <= warmup:
        return None
    index = (step - warmup - 1) // block
    order = MODES if (index // 2) % 2 == 0 else MODES[::-1]
    return order[index % 2]


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


def toggling_steps(warmup: int, block: int) -> type[loop.Steps]:
    """loop.Steps whose batches lose their worker plans in the "step plans" blocks."""

    class ToggledSteps(loop.Steps):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.batches = PlanToggle(self.batches)
            self.step = 0

        def run(self) -> loop.StepResult:
            self.step += 1
            self.batches.drop = block_mode(self.step, warmup, block) == "step plans"
            return super().run()

    return ToggledSteps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument("--out", required=True, help="run directory (train.output_dir); ab.json goes there")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of one block per mode")
    parser.add_argument("--block", type=int, default=5, help="optimizer steps per block = per log interval")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the first block (compile, allocator)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    if min(args.rounds, args.block) < 1 or args.warmup < 0 or args.warmup % args.block:
        parser.error("--rounds and --block must be at least 1, --warmup a multiple of --block")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    steps = args.warmup + 2 * args.rounds * args.block
    overrides = [
        *args.overrides,
        f"train.max_steps={steps}",
        f"logging.every_steps={args.block}",
        f"logging.timing_warmup_steps={args.warmup}",
        f"train.output_dir={args.out}",
    ]
    real_steps = loop.Steps
    loop.Steps = toggling_steps(args.warmup, args.block)
    try:
        train.main(["--config", args.config, *overrides])
    finally:
        loop.Steps = real_steps
    records = [json.loads(line) for line in (Path(args.out) / "metrics.jsonl").read_text().splitlines()]
    blocks = [
        {
            "last_step": r["step"],
            "mode": block_mode(r["step"], args.warmup, args.block),
            "step_time_s": r["step_time_s"],
        }
        for r in records
        if r.get("step_time_s") is not None and r["step"] > args.warmup
    ]
    medians = {mode: statistics.median(b["step_time_s"] for b in blocks if b["mode"] == mode) for mode in MODES}
    report = {
        "config": args.config,
        "overrides": args.overrides,
        "block_steps": args.block,
        "blocks": blocks,
        "median_step_time_s": medians,
        "step_plans_over_worker_plans": medians["step plans"] / medians["worker plans"],
    }
    for b in blocks:
        print(f"[ab] steps to {b['last_step']} ({b['mode']}): {1e3 * b['step_time_s']:.1f} ms/step")
    print(json.dumps({k: report[k] for k in ("median_step_time_s", "step_plans_over_worker_plans")}, indent=2))
    (Path(args.out) / "ab.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
