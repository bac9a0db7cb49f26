"""Inductor calling aten's own kernels for the norms' row reductions, so compiled blocks normalise in eager's order.

Inductor generates its own reduction for an RMSNorm's fp32 mean of squares and, backward, for the sum over the
hidden width that gives the input's gradient, adding in another order than aten's kernels. The last bits differ,
and where that lands next to a bf16 rounding boundary (the cast for the next matmul) a bf16 value flips by one
unit; from a random init Adam's first steps grow such flips into a loss curve outside the eager path's run-to-run
spread (docs/numerics.md). Lowered to aten's kernels, which inductor then calls as extern kernels between its fused
ones, a compiled block's forward and input gradients equal eager's:

- every sum and mean over the last dimension alone (`aten.sum.dim_IntList`, `aten.mean.dim`): the norms' mean of
  squares and their input gradients' sums over the width. Sums over tokens (the norm weights' and the ViT linears'
  bias gradients) stay inductor's: they reach no activation, and on aten they would write bf16 gradients out in full.
- the layer norms whole (the ViT blocks of Qwen2-VL, Qwen3-VL and Qwen3.5 use nn.LayerNorm), forward and backward:
  inductor decomposes them into its own mean and variance before any lowering is looked up, so their
  decompositions leave inductor's tables while the change holds. Forward and backward go to aten together: for a
  bf16 input with fp32 weights (CPU autocast leaves layer norms' inputs as they are) aten's forward returns its
  mean and rstd in fp32 where the fake tensors inductor plans with say bf16, and a backward of inductor's own would
  read them as bf16.

The cost: each lowered reduction's input is written out in full instead of being reduced where it is computed
(docs/performance.md).

Lowerings are process-wide: `lower_norm_reductions()` changes inductor's tables for every graph compiled after it
and returns the function that puts them back. Inductor's FX-graph cache and AOTAutograd's cache key on the graph
and the configs, not on the lowerings, so both stay off while the change holds: a graph compiled before it, with
inductor's own reductions, is never reused from disk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch._functorch.config
import torch._inductor.config
from torch._inductor import decomposition, lowering

aten = torch.ops.aten
# Lowered to aten's kernels wherever they occur (every overload)
LAYER_NORM_OPS: tuple[torch._ops.OpOverloadPacket, ...] = (aten.native_layer_norm, aten.native_layer_norm_backward)
# Lowered to aten's kernels only where they reduce each row (the last dimension alone)
ROW_OPS: tuple[torch._ops.OpOverload, ...] = (aten.sum.dim_IntList, aten.mean.dim)
_CACHES = ((torch._inductor.config, "fx_graph_cache"), (torch._functorch.config, "enable_autograd_cache"))


def overloads(packets: Sequence[torch._ops.OpOverloadPacket]) -> list[torch._ops.OpOverload]:
    """Every overload of `packets` (torch 2.11 has no `OpOverloadPacket.op_overloads()`)."""
    return [getattr(packet, name) for packet in packets for name in packet.overloads()]


def decomposition_tables() -> tuple[dict, ...]:
    """The decomposition tables AOTAutograd traces inductor's graphs with (`select_decomp_table` returns one of them,
    the second a cached copy of the first with faster random ops)."""
    return decomposition.decompositions, decomposition.fast_random_decomps()


def lower_norm_reductions() -> Callable[[], None]:
    """Make inductor call aten's kernels for the layer norms (LAYER_NORM_OPS, every overload: their decompositions
    leave inductor's tables and they become fallbacks) and for ROW_OPS where they reduce the last dimension alone
    (elsewhere inductor lowers them as before), with its compile caches off. Returns the function that undoes all of
    it. Call it before the graphs compile (blocks compile at their first forward)."""
    tracked = (*LAYER_NORM_OPS, *overloads(LAYER_NORM_OPS), *ROW_OPS)
    lowerings_before = {op: lowering.lowerings.get(op) for op in tracked}
    fallbacks_before = {op for op in tracked if op in lowering.fallbacks}
    realized_before = {op for op in tracked if op in lowering.needs_realized_inputs}
    decompositions_removed = [
        (table, op, table.pop(op)) for table in decomposition_tables() for op in tracked if op in table
    ]
    caches_before = [(config, name, getattr(config, name)) for config, name in _CACHES]
    for packet in LAYER_NORM_OPS:
        lowering.make_fallback(packet, warn=False, override_decomp=True)
    for op in ROW_OPS:
        lowering.lowerings[op] = _rows_to_aten(op, lowering.lowerings[op])
    for config, name, _ in caches_before:
        setattr(config, name, False)

    def undo() -> None:
        for table, op, decomposed in decompositions_removed:
            table[op] = decomposed
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


def reduces_rows_only(dims, rank: int) -> bool:
    """Whether reduced `dims` (an int, a list, or None = all) are the last of `rank` dimensions alone."""
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return rank > 0 and bool(dims) and {dim % rank for dim in dims} == {rank - 1}


def _rows_to_aten(op: torch._ops.OpOverload, inductor_lowering: Callable) -> Callable:
    """A lowering of `op` (x, dims, ...) that calls aten's kernel for a reduction over x's last dimension alone (aten
    realizes its input) and inductor's own lowering otherwise."""
    aten_kernel = lowering.fallback_handler(op, add_to_fallback_set=False)

    def lower(x, dims=None, *args, **kwargs):
        if reduces_rows_only(dims, len(x.get_size())):
            return aten_kernel(x, dims, *args, **kwargs)
        return inductor_lowering(x, dims, *args, **kwargs)

    lower.rows_to_aten = True  # for tests: which lowering is in place
    return lower
