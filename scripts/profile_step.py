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

Categories come from kernel-name patterns (CATEGORIES below): a heuristic. The first matching pattern wins and
unmatched names land in `other`, so categories always sum to the total. Known blind spots: transformers' unfused
rope (rotate_half: neg/cat/mul/add) and its RMSNorm (pow/mean/rsqrt/mul) run as generic elementwise kernels that
no name separates from other elementwise work; only our fused Triton rope kernels and fused norm kernels (the
ViT's LayerNorm) are counted under `rope` and `norm`. The training loss (trainer/loss.py's fused lm_head +
cross-entropy) runs as GEMMs, under `matmul`, and generic exp/max/sum kernels, under `elementwise`.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from core.config import load_config
from core.config_tree import ConfigError
from trainer import loop
from trainer.setup import build_accelerator, build_training
from trainer.step import PHASE
from verification.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]

# (category, regex searched case-insensitively in the kernel / op name). Ordered: the first match wins, so the
# specific patterns come before the broad ones (fmha before cutlass, multi_tensor norm before norm, ...).
CATEGORIES: tuple[tuple[str, str], ...] = (
    # our Triton kernels (mrope_kernels/triton_rope.py); on CPU, their autograd functions (mrope_kernels/ops.py)
    ("rope", r"_rope_kernel|_rotate_(heads|rows)|mrope_kernels::|_ropefunction"),
    # flash-linear-attention's kernels (Qwen3.5's linear-attention layers); the "torch" backend's generic ops
    # cannot be told apart from other elementwise/matmul work.
    ("gated_delta", r"gated_delta|chunk_(local|fwd|bwd|scaled)|recompute_w_u|solve_tril|recurrent|causal_conv1d"),
    ("attention", r"flash|fmha|varlen|sdpa|scaled_dot_product|attention"),
    ("optimizer", r"adam|foreach|multi_tensor"),
    ("communication", r"nccl|all_?reduce|reduce_?scatter|all_?gather|c10d"),
    ("norm", r"rms_?norm|layer_?norm"),
    # the ViT's patch embedding is a Conv3d with stride = kernel: a GEMM in cuDNN's clothes
    (
        "matmul",
        r"gemm|cutlass|cublas|nvjet|sm90_|sm80_|xmma|convol|conv\dd|fprop|dgrad|wgrad|"
        r"aten::(mm|addmm|bmm|baddbmm|addmv|matmul|linear)$",
    ),
    ("loss", r"softmax|cross_entropy|nll_loss"),
    ("copies_casts", r"memcpy|memset|copy|cast|catarray|aten::(cat|clone|contiguous|to|_to_copy|stack)$"),
    (
        "elementwise",
        r"elementwise|vectorized|reduce_kernel|"
        r"aten::(add|sub|mul|div|neg|pow|rsqrt|sqrt|exp|log|silu|gelu|sigmoid|tanh|mean|sum|where|fill|zero|"
        r"masked_fill|threshold_backward|gelu_backward|silu_backward|sigmoid_backward|tanh_backward)_?$",
    ),
)
OTHER = "other"
_COMPILED = tuple((category, re.compile(pattern, re.IGNORECASE)) for category, pattern in CATEGORIES)
STEP_ANNOTATION = "profile_step/optimizer_step_"
NAME_WIDTH = 90


@dataclass(frozen=True)
class DeviceEvent:
    """One unit of device work: a GPU kernel/memcpy/memset (CUDA) or a CPU op (without CUDA).

    start_us/end_us: its interval on the profiler clock (µs); self_us: time attributed to it alone (a kernel's
    duration; a CPU op's self time, so nested ops are not counted twice).
    """

    name: str
    start_us: float
    end_us: float
    self_us: float


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


def categorize(name: str) -> str:
    """The category of a kernel or op name: the first CATEGORIES pattern found in it, else `other`."""
    for category, pattern in _COMPILED:
        if pattern.search(name):
            return category
    return OTHER


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_events(prof: profile, on_cuda: bool) -> list[DeviceEvent]:
    """The profiled device work: GPU kernels, memcpys and memsets with CUDA, else CPU ops (our step annotations
    excluded: they are not work)."""
    events = []
    for event in prof.events():
        if event.is_user_annotation or event.name.startswith(STEP_ANNOTATION):
            continue
        start, end = event.time_range.start, event.time_range.end
        if on_cuda and event.device_type == torch.autograd.DeviceType.CUDA:
            events.append(DeviceEvent(event.name, start, end, end - start))
        elif not on_cuda and event.device_type == torch.autograd.DeviceType.CPU:
            events.append(DeviceEvent(event.name, start, end, event.self_cpu_time_total))
    return events


def busy_us(events: list[DeviceEvent]) -> float:
    """Length of the union of the events' intervals (µs): time during which the device ran anything."""
    total, covered_until = 0.0, -math.inf
    for event in sorted(events, key=lambda e: e.start_us):
        if event.end_us > covered_until:
            total += event.end_us - max(event.start_us, covered_until)
            covered_until = event.end_us
    return total


def host_ranges(prof: profile, prefix: str) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the host annotations whose name starts with `prefix`, by start."""
    ranges = [
        (event.name, event.time_range.start, event.time_range.end)
        for event in prof.events()
        if event.name.startswith(prefix) and event.device_type == torch.autograd.DeviceType.CPU
    ]
    return sorted(ranges, key=lambda r: r[1])


def host_ops(prof: profile) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every host event but the step annotations (aten ops, CUDA runtime calls, the
    step phases), by start."""
    ops = [
        (event.name, event.time_range.start, event.time_range.end)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CPU and not event.name.startswith(STEP_ANNOTATION)
    ]
    return sorted(ops, key=lambda r: r[1])


def idle_gaps(events: list[DeviceEvent], window: tuple[float, float]) -> list[tuple[float, float]]:
    """(start_us, end_us) of every gap in the union of `events` inside `window`: when the device ran nothing."""
    start, end = window
    gaps, covered_until = [], start
    for event in sorted(events, key=lambda e: e.start_us):
        if event.start_us > covered_until and event.start_us > start:
            gaps.append((covered_until, min(event.start_us, end)))
        covered_until = max(covered_until, event.end_us)
    if covered_until < end:
        gaps.append((covered_until, end))
    return [(gap_start, gap_end) for gap_start, gap_end in gaps if gap_end > gap_start]


def charge_gaps(
    gaps: list[tuple[float, float]], ranges: list[tuple[str, float, float]], steps: int, outside: str
) -> list[dict]:
    """Each gap charged to the innermost of the host `ranges` ((name, start_us, end_us), sorted by start) that holds
    its midpoint (nested ranges: the one that started last), or to `outside` when none does.
    Returns [{name, idle_ms_per_step, gaps_per_step}], most idle first."""
    # A sweep over the gaps in midpoint order: `open_ranges` is a heap of the ranges begun so far, latest start on
    # top; one that ended before a midpoint has ended before every later one too, so it is dropped for good.
    per_name: dict[str, list[float]] = {}
    open_ranges: list[tuple[float, float, str]] = []
    begun = 0
    for gap_start, gap_end in sorted(gaps, key=lambda gap: gap[0] + gap[1]):
        middle = (gap_start + gap_end) / 2
        while begun < len(ranges) and ranges[begun][1] <= middle:
            name, start, end = ranges[begun]
            heapq.heappush(open_ranges, (-start, end, name))
            begun += 1
        while open_ranges and open_ranges[0][1] < middle:
            heapq.heappop(open_ranges)
        name = open_ranges[0][2] if open_ranges else outside
        idle_and_count = per_name.setdefault(name, [0.0, 0])
        idle_and_count[0] += gap_end - gap_start
        idle_and_count[1] += 1
    rows = [
        {"name": name, "idle_ms_per_step": us / 1e3 / steps, "gaps_per_step": count / steps}
        for name, (us, count) in per_name.items()
    ]
    return sorted(rows, key=lambda row: row["idle_ms_per_step"], reverse=True)


def idle_by_phase(
    events: list[DeviceEvent], phases: list[tuple[str, float, float]], window: tuple[float, float], steps: int
) -> list[dict]:
    """Where the GPU sat idle: every gap in the union of `events` inside `window` (the profiled steps), charged to
    the step phase (trainer/step.py's PHASE annotations) that the host was in at the gap's midpoint, the innermost
    one when they nest; gaps outside every phase are "between phases". The host's phase while the GPU waits is what
    held it up: a loader that is late (data_wait), Python that launches slower than the GPU runs, or the relaunch
    after a host sync. Returns [{phase, idle_ms_per_step, gaps_per_step}], most idle first."""
    rows = charge_gaps(idle_gaps(events, window), phases, steps, outside=PHASE + "between phases")
    return [{"phase": row.pop("name").removeprefix(PHASE), **row} for row in rows]


def idle_by_host_op(
    events: list[DeviceEvent], host_ops: list[tuple[str, float, float]], window: tuple[float, float], steps: int
) -> list[dict]:
    """What the host was doing while the GPU sat idle: each gap charged to the innermost host op or annotation
    (`host_ops`: aten ops, CUDA runtime calls, step phases; sorted by start) running at its midpoint. A sync shows
    up as the runtime call that waits (cudaStreamSynchronize, cudaMemcpy, cudaHostAlloc ...), Python that launches
    too slowly as the phase or the op that runs it. Returns [{op, idle_ms_per_step, gaps_per_step}], most idle
    first."""
    rows = charge_gaps(idle_gaps(events, window), host_ops, steps, outside="(no host op)")
    return [{"op": row.pop("name"), **row} for row in rows]


def summarize(events: list[DeviceEvent], steps: int, wall_s: float, top: int) -> dict:
    """Per-kernel and per-category device time of `steps` profiled steps that took `wall_s` seconds.

    Returns {"kernels": [{name, category, calls, total_ms, pct}] (top `top` by total), "categories":
    [{category, ms_per_step, pct}] (every category, CATEGORIES order, `other` last), wall/device/busy ms per step,
    busy_fraction, launches_per_step, distinct_kernels}.
    Percentages are of the summed device time; with overlapping streams that sum can exceed the busy time.
    """
    per_name: dict[str, list[float]] = {}
    for event in events:
        calls_and_us = per_name.setdefault(event.name, [0, 0.0])
        calls_and_us[0] += 1
        calls_and_us[1] += event.self_us
    total_us = sum(us for _, us in per_name.values())

    def pct(us: float) -> float:
        return 100.0 * us / total_us if total_us > 0 else 0.0

    ranked = sorted(per_name.items(), key=lambda item: item[1][1], reverse=True)
    kernels = [
        {"name": name, "category": categorize(name), "calls": int(calls), "total_ms": us / 1e3, "pct": pct(us)}
        for name, (calls, us) in ranked[:top]
    ]
    category_us = {category: 0.0 for category, _ in CATEGORIES} | {OTHER: 0.0}
    for name, (_, us) in per_name.items():
        category_us[categorize(name)] += us
    categories = [
        {"category": category, "ms_per_step": us / 1e3 / steps, "pct": pct(us)} for category, us in category_us.items()
    ]
    wall_ms_per_step = wall_s * 1e3 / steps
    busy_ms_per_step = busy_us(events) / 1e3 / steps
    return {
        "steps": steps,
        "wall_ms_per_step": wall_ms_per_step,
        "device_ms_per_step": total_us / 1e3 / steps,
        "busy_ms_per_step": busy_ms_per_step,
        "busy_fraction": busy_ms_per_step / wall_ms_per_step if wall_ms_per_step > 0 else 0.0,
        "launches_per_step": len(events) / steps,
        "distinct_kernels": len(per_name),
        "kernels": kernels,
        "categories": categories,
    }


def _short(name: str) -> str:
    name = name.replace("|", "/")  # keeps the markdown table intact
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 1] + "…"


def render(report: dict) -> str:
    """profile.md: the run, the step timing, the category breakdown and the top kernels, as markdown tables."""
    unit = "GPU kernels" if report["on_cuda"] else "CPU ops (no CUDA: plumbing only)"
    lines = [
        f"# Step profile: {report['config']} ({'fused' if report['fused_rope'] else 'unfused'} rope)",
        "",
        f"{report['provenance']['gpu']['name']}; {report['steps']} profiled steps after {report['warmup']} warm-up; "
        f"device work = {unit}.",
        f"Overrides: {' '.join(report['overrides']) or 'none'}",
        "",
        "| per step | value |",
        "|---|---:|",
        f"| wall ms | {report['wall_ms_per_step']:.2f} |",
        f"| device work ms (summed) | {report['device_ms_per_step']:.2f} |",
        f"| device busy ms (union) | {report['busy_ms_per_step']:.2f} |",
        f"| busy fraction of wall | {100 * report['busy_fraction']:.1f}% |",
        f"| device work items (kernels / ops) | {report['launches_per_step']:.0f} |",
        "",
        "## Device time by category (kernel-name heuristic, see CATEGORIES in scripts/profile_step.py)",
        "",
        "| category | ms/step | % |",
        "|---|---:|---:|",
        *(f"| {c['category']} | {c['ms_per_step']:.3f} | {c['pct']:.1f} |" for c in report["categories"]),
        "",
        "Unfused rope (rotate_half) and transformers' RMSNorm run as generic elementwise/copy kernels: they are in",
        "`elementwise`/`copies_casts`, not in `rope`/`norm` (the same holds for the torch gated-delta backend).",
        "",
        f"## Top {len(report['kernels'])} of {report['distinct_kernels']} kernels by total time",
        "",
        "| # | kernel | category | calls | total ms | % |",
        "|---:|---|---|---:|---:|---:|",
        *(
            f"| {i} | {_short(k['name'])} | {k['category']} | {k['calls']} | {k['total_ms']:.3f} | {k['pct']:.1f} |"
            for i, k in enumerate(report["kernels"], 1)
        ),
    ]
    if report["idle"]:
        lines += [
            "",
            "## GPU idle time by the host's step phase (at each gap's midpoint)",
            "",
            "| phase | idle ms/step | gaps/step |",
            "|---|---:|---:|",
            *(f"| {r['phase']} | {r['idle_ms_per_step']:.2f} | {r['gaps_per_step']:.1f} |" for r in report["idle"]),
        ]
    if report.get("idle_host_ops"):
        lines += [
            "",
            "## GPU idle time by the host op running at each gap's midpoint (innermost)",
            "",
            "| host op | idle ms/step | gaps/step |",
            "|---|---:|---:|",
            *(
                f"| {_short(r['op'])} | {r['idle_ms_per_step']:.2f} | {r['gaps_per_step']:.1f} |"
                for r in report["idle_host_ops"]
            ),
        ]
    return "\n".join(lines) + "\n"


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
