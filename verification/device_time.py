"""Device time from a torch.profiler run, by category: the analysis behind scripts/profile_step.py (its docstring
says what is measured and the categories' blind spots).

`device_events` reads the profiled device work (GPU kernels, memcpys, memsets; CPU ops without CUDA), `categorize`
names a kernel's category by CATEGORIES, `summarize` adds them up (top kernels, categories, busy time),
`idle_by_phase` / `idle_by_host_op` charge the device's idle gaps to what the host was doing, `render` writes the
table.
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass

import torch
from torch.profiler import profile

from trainer.step import PHASE

# (category, regex searched case-insensitively in the kernel / op name). Ordered: the first match wins, so the
# specific patterns come before the broad ones (fmha before cutlass, multi_tensor norm before norm, ...).
CATEGORIES: tuple[tuple[str, str], ...] = (
    # our Triton kernels (mrope_kernels/triton_rope.py: the text rope and the ViT's table rope); on CPU, their
    # autograd functions (mrope_kernels/ops.py)
    ("rope", r"_rope_kernel|_vision_table_kernel|_rotate_(heads|rows)|mrope_kernels::|_ropefunction"),
    # flash-linear-attention's kernels (Qwen3.5's linear-attention layers); the "torch" backend's generic ops
    # cannot be told apart from other elementwise/matmul work.
    ("gated_delta", r"gated_delta|chunk_(local|fwd|bwd|scaled)|recompute_w_u|solve_tril|recurrent|causal_conv1d"),
    # FlashAttention-2/-4 (FA4's CuTe kernels are named kernel_cutlass_..._flash_attncute...: before "matmul"'s cutlass)
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


def categorize(name: str) -> str:
    """The category of a kernel or op name: the first CATEGORIES pattern found in it, else `other`."""
    for category, pattern in _COMPILED:
        if pattern.search(name):
            return category
    return OTHER


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
