"""Inductor lowering sum and mean to aten's own kernels, so the compiled blocks' reductions add in eager's order.

Why (docs/benchmarks.md, "Thirteenth session"): with eager's bf16 roundings emulated
(`train.compile_emulate_precision_casts`), what is left between a compiled decoder layer and eager is the RMSNorms.
Inductor generates its own reduction for a norm's fp32 mean of squares, and backward for the sums that give the
input's and the weight's gradients, adding in another order than aten's kernels. The last bits differ, and where
that lands next to a bf16 rounding boundary (the cast for the next matmul) a bf16 value flips by one unit. With sum
and mean lowered to aten's kernels, which inductor then calls as extern kernels between its fused ones, a compiled
Qwen2 decoder layer equals eager bit for bit on the CPU, forward and backward (scripts/compile_accuracy.py). The
cost: each reduction's input is written out in full instead of being reduced where it is computed.

Lowerings are process-wide: `lower_reductions_to_aten()` changes inductor's table for every graph compiled after it
and returns the function that puts the table back. Inductor's FX-graph cache and AOTAutograd's cache key on the graph
and the configs, not on the lowerings, so both stay off while the change holds: a graph compiled before it, with
inductor's own reductions, is never reused from disk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._functorch.config
import torch._inductor.config
from torch._inductor import lowering

REDUCTIONS = (torch.ops.aten.sum, torch.ops.aten.mean)
_CACHES = ((torch._inductor.config, "fx_graph_cache"), (torch._functorch.config, "enable_autograd_cache"))


def lower_reductions_to_aten() -> Callable[[], None]:
    """Make inductor call aten's sum and mean kernels (every overload) instead of generating its own, with its
    compile caches off; returns the function that undoes both. Call it before the graphs compile (blocks compile at
    their first forward)."""
    overloads = [overload for packet in REDUCTIONS for overload in packet.op_overloads()]
    tracked = (*REDUCTIONS, *overloads)
    lowerings_before = {op: lowering.lowerings.get(op) for op in tracked}
    fallbacks_before = {op for op in tracked if op in lowering.fallbacks}
    realized_before = {op for op in tracked if op in lowering.needs_realized_inputs}
    caches_before = [(config, name, getattr(config, name)) for config, name in _CACHES]
    for packet in REDUCTIONS:
        lowering.make_fallback(packet, warn=False, override_decomp=True)
    for config, name, _ in caches_before:
        setattr(config, name, False)

    def undo() -> None:
        for op, previous in lowerings_before.items():
            if previous is None:
                lowering.lowerings.pop(op, None)
            else:
                lowering.lowerings[op] = previous
            if op not in fallbacks_before:
                lowering.fallbacks.discard(op)
            if op not in realized_before:
                lowering.needs_realized_inputs.discard(op)
        for config, name, value in caches_before:
            setattr(config, name, value)

    return undo
