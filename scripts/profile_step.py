"""Where a training step's time goes: a recipe's optimizer steps under torch.profiler, kernels by category.

    python -m scripts.profile_step --config recipes/bench-qwen2_5_vl-3b-shape.yaml [--steps 3] [--warmup 3] \
        [--out DIR] [--top 25] [dotted.key=value ...]
    make profile CONFIG=recipes/... ARGS="--steps 3 kernels.mrope=unfused"

The model, data, optimizer and steps are train.py's (trainer/setup.py's build_training, trainer/loop.py's
Steps); `--warmup` optimizer steps run unprofiled (allocator growth, Triton autotuning), then `--steps`
steps run under the profiler with the device synchronised only before the first and after the last. Writes into
--out (default artifacts/profile/<recipe>-<rope>; its rank<i>/ per process under accelerate launch):
  trace.json    chrome trace (open in https://ui.perfetto.dev or chrome://tracing)
  profile.md    the top kernels and the category breakdown (also printed)
  profile.json  the same numbers
With CUDA, "device time" is the summed duration of GPU kernels, memcpys and memsets, and "busy" is the fraction of
the profiled wall time during which at least one of them ran (1 - busy = idle gaps: host-bound steps). Without
CUDA, the CPU ops' self times stand in for kernels (plumbing only: the numbers say nothing about a GPU).

Categories come from kernel-name patterns (CATEGORIES in verification/device_time.py): a heuristic. The first
matching pattern wins and unmatched names land in `other`, so categories always sum to the total. Known blind
spots: transformers' unfused rope (rotate_half: neg/cat/mul/add) and its RMSNorm (pow/mean/rsqrt/mul) run as
generic elementwise kernels that no name separates from other elementwise work; only our fused Triton rope kernels
and fused norm kernels (the ViT's LayerNorm) are counted under `rope` and `norm`. The training loss
(trainer/loss.py's fused lm_head + cross-entropy) runs as GEMMs, under `matmul`, and generic exp/max/sum kernels,
under `elementwise`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from core.config import load_config
from core.config_tree import ConfigError
from trainer import loop
from trainer.setup import build_accelerator, build_training
from trainer.step import PHASE
from verification.device_time import (
    STEP_ANNOTATION,
    device_events,
    host_ops,
    host_ranges,
    idle_by_host_op,
    idle_by_phase,
    render,
    summarize,
)
from verification.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/bench-qwen2_5_vl-3b-shape.yaml")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps profiled")
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps run first, unprofiled")
    parser.add_argument("--out", default=None, help="output directory (default: artifacts/profile/<recipe>-<rope>)")
    parser.add_argument("--top", type=int, default=25, help="kernels listed in the table")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. kernels.mrope=unfused")
    args = parser.parse_args(argv)
    for flag in ("steps", "top"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")
    return args


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_out(config_path: str, fused_rope: bool) -> Path:
    return ROOT / "artifacts" / "profile" / f"{Path(config_path).stem}-{'fused' if fused_rope else 'unfused'}"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    accelerator = build_accelerator(cfg)
    setup = build_training(cfg, accelerator)
    device = accelerator.device
    on_cuda = device.type == "cuda"
    out_dir = Path(args.out) if args.out else default_out(args.config, setup.fused_rope)
    if accelerator.num_processes > 1:  # under accelerate launch every rank profiles its own GPU
        out_dir = out_dir / f"rank{accelerator.process_index}"
    out_dir.mkdir(parents=True, exist_ok=True)

    steps = loop.Steps(accelerator, setup, cfg.train)
    try:
        for _ in range(args.warmup):
            steps.run()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        synchronize(device)
        with profile(activities=activities, record_shapes=False) as prof:
            start = time.perf_counter()
            for step in range(args.steps):
                with record_function(f"{STEP_ANNOTATION}{step}"):  # step boundaries in the trace
                    steps.run()
            synchronize(device)
            wall_s = time.perf_counter() - start
    finally:
        steps.close()

    prof.export_chrome_trace(str(out_dir / "trace.json"))
    events = device_events(prof, on_cuda)
    step_ranges = host_ranges(prof, STEP_ANNOTATION)
    window = (step_ranges[0][1], max(end for _, _, end in step_ranges))
    report = {
        "config": args.config,
        "overrides": args.overrides,
        "provenance": provenance(),
        "on_cuda": on_cuda,
        "fused_rope": setup.fused_rope,
        "warmup": args.warmup,
        **summarize(events, args.steps, wall_s, args.top),
        # without CUDA the "device" is the host itself: it is never idle waiting for itself
        "idle": idle_by_phase(events, host_ranges(prof, PHASE), window, args.steps) if on_cuda else [],
        "idle_host_ops": idle_by_host_op(events, host_ops(prof), window, args.steps)[: args.top] if on_cuda else [],
    }
    table = render(report)
    (out_dir / "profile.md").write_text(table)
    (out_dir / "profile.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table)
    print(f"[profile] wrote {out_dir}/trace.json, profile.md, profile.json")
    return report


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:
        sys.exit(f"config error: {error}")
