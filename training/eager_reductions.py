"""Inductor calling aten's own kernels for sums, means and layer norms, so the compiled blocks' norms add in eager's
order.

Why (docs/benchmarks.md, "Thirteenth session" and "Fourteenth session"): with eager's bf16 roundings emulated
(`train.compile_emulate_precision_casts`), what is left between a compiled decoder layer and eager is the RMSNorms.
Inductor generates its own reduction for a norm's fp32 mean of squares, and backward for the sums that give the
input's and the weight's gradients, adding in another order than aten's kernels. The last bits differ, and where
that lands next to a bf16 rounding boundary (the cast for the next matmul) a bf16 value flips by one unit; over a
30-step run of the 3B shape the compiled curve left the eager one by 0.29-0.43 where eager's own repeat left it by
0.08-0.17. Lowered to aten's kernels, which inductor then calls as extern kernels between its fused ones:

- "all" (every sum and mean, forward and backward, and the layer norms' forward and backward): a compiled Qwen2
  decoder layer equals eager bit for bit on the CPU, forward and backward, and its output on the H200
  (scripts/compile_accuracy.py); the 30-step curve stayed within 0.063 and 0.014 of eager's in two draws. It cost
  4.9% of the 3B shape's throughput on the H200 (whose blocks have RMSNorms only).
- "mean" (the RMSNorms' forward mean of squares, and the layer norms): the forward equals eager's, as with "all";
  the RMSNorms' backward sums stay inductor's, fused where they are computed. It cost 2.6% of the 3B shape's
  throughput on the H200, but its 30-step curve left eager's by 0.249 where eager's repeat stayed within 0.058
  ("Sixteenth session"): the backward's sums matter to the curve too.
- "rows" (every sum and mean over the last dimension alone, and the layer norms): the RMSNorms' mean of squares
  and, backward, their sums over the hidden width that make the input's gradient, as "all" has them; the sums over
  tokens (the norm weights' and the ViT linears' bias gradients) stay inductor's. Half of "all"'s aten reduction
  time on the 3B shape was those column sums of bf16 gradients ("Seventeenth session"), and they reach no
  activation. On the H200 ("Eighteenth session") it cost nothing measurable on the 3B shape, and its 30-step curve
  left eager's by 0.037, 0.087, 0.089 and 0.227 in four draws, within two of the four per-draw bars ("Nineteenth
  session"); on the 8B shape, whose ViT norms with nn.LayerNorm, the layer norms on aten's kernels cost 5.1% and 2.4
  GiB of peak memory.

The ViT blocks of Qwen2-VL, Qwen3-VL and Qwen3.5 norm with nn.LayerNorm, which inductor decomposes into its own
mean and variance reductions before any lowering is looked up: the layer norms' decompositions leave inductor's
tables while the change holds, so aten's fused layer-norm kernels run as eager runs them. A layer norm goes to aten
forward and backward together: for a bf16 input with fp32 weights (CPU autocast leaves layer norms' inputs as they
are) aten's forward returns its mean and rstd in fp32 where the fake tensors inductor plans with say bf16, so a
backward of inductor's own would read them as bf16 (NaN gradients, on the CPU); aten's backward takes them as they
are.

The cost: each lowered reduction's input is written out in full instead of being reduced where it is computed.

Lowerings are process-wide: `lower_reductions_to_aten()` changes inductor's tables for every graph compiled after it
and returns the function that puts them back. Inductor's FX-graph cache and AOTAutograd's cache key on the graph
and the configs, not on the lowerings, so both stay off while the change holds: a graph compiled before it, with
inductor's own reductions, is never reused from disk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch._functorch.config
import torch._inductor.config
from torch._inductor import decomposition, lowering

aten = torch.ops.aten
EagerReductions = Literal["none", "mean", "rows", "all"]
# What each `train.compile_eager_reductions` setting lowers to aten's kernels, always
LOWERED: dict[str, tuple[torch._ops.OpOverloadPacket, ...]] = {
    "none": (),
    "mean": (aten.mean, aten.native_layer_norm, aten.native_layer_norm_backward),
    "rows": (aten.native_layer_norm, aten.native_layer_norm_backward),
    "all": (aten.sum, aten.mean, aten.native_layer_norm, aten.native_layer_norm_backward),
}
# ... and only where they reduce each row (the last dimension alone): a norm's mean of squares, and backward its sum
# over the hidden width for the input's gradient; sums over tokens (weight and bias gradients) stay inductor's
ROW_LOWERED: dict[str, tuple[torch._ops.OpOverload, ...]] = {"rows": (aten.sum.dim_IntList, aten.mean.dim)}
_CACHES = ((torch._inductor.config, "fx_graph_cache"), (torch._functorch.config, "enable_autograd_cache"))


def overloads(packets: Sequence[torch._ops.OpOverloadPacket]) -> list[torch._ops.OpOverload]:
    """Every overload of `packets` (torch 2.11, on the GPU machine, has no `OpOverloadPacket.op_overloads()`)."""
    return [getattr(packet, name) for packet in packets for name in packet.overloads()]


def decomposition_tables() -> tuple[dict, ...]:
    """The decomposition tables AOTAutograd traces inductor's graphs with (`select_decomp_table` returns one of them,
    the second a cached copy of the first with faster random ops)."""
    return decomposition.decompositions, decomposition.fast_random_decomps()


def lower_setting(which: EagerReductions) -> Callable[[], None]:
    """`lower_reductions_to_aten` for a `train.compile_eager_reductions` setting; returns its undo."""
    return lower_reductions_to_aten(LOWERED[which], ROW_LOWERED.get(which, ()))


def lower_reductions_to_aten(
    packets: Sequence[torch._ops.OpOverloadPacket] = LOWERED["all"], row_ops: Sequence[torch._ops.OpOverload] = ()
) -> Callable[[], None]:
    """Make inductor call aten's kernels for `packets` (every overload; default LOWERED["all"]) instead of generating
    its own reductions: their decompositions leave inductor's tables and they become fallbacks, with its compile
    caches off; `row_ops` (overloads taking reduced dims) go to aten only where they reduce the last dimension alone,
    elsewhere inductor lowers them as before. Returns the function that undoes all of it. Call it before the graphs
    compile (blocks compile at their first forward)."""
    tracked = (*packets, *overloads(packets), *row_ops)
    lowerings_before = {op: lowering.lowerings.get(op) for op in tracked}
    fallbacks_before = {op for op in tracked if op in lowering.fallbacks}
    realized_before = {op for op in tracked if op in lowering.needs_realized_inputs}
    decompositions_removed = [
        (table, op, table.pop(op)) for table in decomposition_tables() for op in tracked if op in table
    ]
    caches_before = [(config, name, getattr(config, name)) for config, name in _CACHES]
    for packet in packets:
        lowering.make_fallback(packet, warn=False, override_decomp=True)
    for op in row_ops:
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
