"""Boundary-exact Qwen3.5 Gated DeltaNet on packed batches.

The Gated DeltaNet layer carries a causal depthwise conv and a recurrent state along the sequence; in a pack both
must restart at every sample. transformers never infers these boundaries (5.17 mixes samples silently, 5.23 raises
without flash-linear-attention), so each layer's forward is wrapped here, with one of two backends:

- "fla": flash-linear-attention's varlen kernels get the pack's `cu_seqlens` explicitly —
  `fla.modules.convolution.causal_conv1d(x, …, cu_seqlens=…)` and
  `fla.ops.gated_delta_rule.chunk_gated_delta_rule(…, cu_seqlens=…)` — on the flat (1, T) pack, no padding.
  Their chunk table (`fla_chunk_indices`) is built on the host from the pack's lengths, once per pack: derived
  from the device `cu_seqlens`, as fla would, it costs a host sync.
- "torch" (everywhere): the layer's own forward with every sample of the pack as its own row of a right-padded
  batch, one batch per power-of-two length class. Conv and delta rule are causal, so the padding after a sample
  never reaches its tokens and each row computes exactly what the sample computes alone. Boundaries come from the
  pack's host-side lengths: no sync.
  Cost: at most 2x the pack's tokens through the layer (64 at least per sample), a few batched calls per layer.

Under context parallelism (the pack keyword is a modeling.context_parallel.ContextShard: this rank's zig-zag
chunks of the pack) the layer all-gathers its input over the context group, runs the forward above on the whole
padded pack with its padded documents' boundaries, and keeps this rank's rows (`_context_parallel_forward`).

Under both backends the layers' module calls transformers' own torch delta rule (it would otherwise pick fla
whenever fla imports), so the layer's original forward (padded batches, fp32 calls) stays the torch math.

Choosing ("auto"): fla needs a CUDA device. On Hopper with 3.4 <= Triton < 3.7.1, fla 0.6.0 refuses its gated
backward (fla issue 640, a Triton miscompile; with tilelang installed fla takes tilelang's kernel instead). There
fla trains only after `modeling.gated_delta_check` has compared it, on this GPU, with transformers' torch delta rule
for the model's own head dims and dtype; the refusal is lifted only then. The check's verdict is cached on disk, so
it and fla's compile are paid once per machine. Otherwise, or when the check fails, the torch path runs. One log
line says which backend runs and why. fp32 runs take the torch path: fla computes fp32 matmuls in TF32.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from modeling import context_parallel, gated_delta_check
from modeling.gated_delta_check import GatedDeltaDims

log = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "fla"]
ORIGINAL_FORWARD_ATTR = "_packed_original_forward"
_DELTA_RULE = "torch_chunk_gated_delta_rule"  # the modeling modules' global that may dispatch to fla
_forced_torch_rule: dict[str, tuple[object, int]] = {}  # modeling module → (its original global, patched models)


def gated_delta_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's Gated DeltaNet modules (Qwen3_5GatedDeltaNet, Qwen3_5MoeGatedDeltaNet, …)."""
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


@dataclass(frozen=True)
class BackendChoice:
    """The backend a model's Gated DeltaNet layers run and the reason, for the run's log."""

    backend: Literal["torch", "fla"]
    reason: str


def fla_blocker() -> str | None:
    """Why fla's kernels cannot run here at all (None when they can)."""
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention is not installed (pip install -r requirements-fla.txt)"
    if not torch.cuda.is_available():
        return "fla's kernels need a CUDA device"
    return None


def fla_refuses_backward() -> bool:
    """True where fla 0.6.0 raises in its gated backward: Hopper with 3.4 <= Triton < 3.7.1 (fla issue 640)."""
    import triton

    triton_version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:3])
    hopper = torch.cuda.get_device_capability()[0] == 9
    return hopper and (3, 4, 0) <= triton_version < (3, 7, 1)


def fla_delta_rule(q, k, v, g, beta, cu_seqlens) -> torch.Tensor:
    """fla's varlen chunked gated delta rule with the layer's settings (gated_delta_check.DeltaRule)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)[0]


@contextlib.contextmanager
def _fla_backward_allowed() -> Iterator[Callable[[], None]]:
    """Lift fla's Hopper refusal (its module flag `TRITON_ABOVE_3_7_1`) inside; restore it on exit unless the
    caller calls the yielded `keep()`."""
    from fla.ops.common import chunk_o

    saved = chunk_o.TRITON_ABOVE_3_7_1
    kept = []
    chunk_o.TRITON_ABOVE_3_7_1 = True
    try:
        yield lambda: kept.append(True)
    finally:
        if not kept:
            chunk_o.TRITON_ABOVE_3_7_1 = saved


def _check_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


FP32_REASON = "the run computes in fp32, and fla's kernels compute fp32 matmuls in TF32"


def _computes_in_fp32(hidden_states: torch.Tensor) -> bool:
    """Whether this call computes in fp32: the autocast dtype where autocast is on, else the input's dtype."""
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type) == torch.float32
    return hidden_states.dtype == torch.float32


def resolve_backend(backend: Backend, dims: set[GatedDeltaDims], dtype: torch.dtype) -> BackendChoice:
    """ "torch" → torch; "fla" and "auto" → fla where it runs and, where fla would refuse its backward, only after
    the numeric self-check passed for each of `dims` in `dtype` on this GPU (gated_delta_check, cached on disk).
    "auto" falls back to torch with the reason; "fla" raises ValueError instead. An fp32 `dtype` takes the torch
    path: fla computes fp32 matmuls in TF32, which is not the precision an fp32 run asks for."""
    if backend == "torch":
        return BackendChoice("torch", "requested (kernels.gated_delta=torch)")
    blocker = fla_blocker()
    if blocker is None and dtype == torch.float32:
        blocker = FP32_REASON
    if blocker is None and fla_refuses_backward():
        passed, summary = _self_check(dims, dtype)
        if passed:
            return BackendChoice("fla", f"{_backward_kernel()}, after its self-check on this GPU passed ({summary})")
        blocker = (
            f"fla failed its numeric self-check against the torch delta rule on this GPU ({summary}; delete that "
            "file to check again)"
        )
    if blocker is None:
        return BackendChoice("fla", "fla's varlen kernels are supported here")
    if backend == "fla":
        raise ValueError(f"Gated DeltaNet backend 'fla' requested but {blocker}; use 'torch' or 'auto'.")
    return BackendChoice("torch", blocker)


def _self_check(dims: set[GatedDeltaDims], dtype: torch.dtype) -> tuple[bool, str]:
    """Run (or read back) the self-check for every head layout with fla's refusal lifted; keep it lifted only
    when every check passed. Returns (passed, summary of the worst quantity and where the verdict is cached)."""
    with _fla_backward_allowed() as keep:
        checks = [
            gated_delta_check.cached_check(fla_delta_rule, d, dtype, _check_device()) for d in sorted(dims, key=str)
        ]
        passed = all(result.passed for result, _ in checks)
        if passed:
            keep()
    source = "cached" if all(cached for _, cached in checks) else "checked now"
    worst = "; ".join(result.worst() for result, _ in checks)
    return passed, f"worst {worst}, {source} in {gated_delta_check.cache_path()}"


def _backward_kernel() -> str:
    if importlib.util.find_spec("tilelang") is not None:
        return "fla with tilelang's gated backward (Triton < 3.7.1 on Hopper)"
    return "fla's Triton gated backward on Hopper with Triton < 3.7.1 (its refusal lifted)"


def _length_classes(lengths: tuple[int, ...]) -> list[list[int]]:
    """Sample indices grouped by power-of-two length class (at least one 64-token delta-rule chunk), so padding a
    group to its longest sample at most doubles its tokens."""
    classes: dict[int, list[int]] = {}
    for index, length in enumerate(lengths):
        classes.setdefault(max(64, 1 << (length - 1).bit_length()), []).append(index)
    return list(classes.values())


def _forward_as_rows(original, hidden_states: torch.Tensor, lengths: tuple[int, ...], **kwargs) -> torch.Tensor:
    """Run `original` with each sample as its own row: (1, T, C) → (1, T, C). One right-padded batch per length
    class; causal layers never let a row's padding reach its tokens."""
    segments = hidden_states[0].split(list(lengths))
    outputs: list[torch.Tensor | None] = [None] * len(lengths)
    for group in _length_classes(lengths):
        rows = torch.nn.utils.rnn.pad_sequence([segments[i] for i in group], batch_first=True)
        out = original(rows, cache_params=None, attention_mask=None, **kwargs)
        for row, index in enumerate(group):
            outputs[index] = out[row, : lengths[index]]
    return torch.cat(outputs).unsqueeze(0)


FLA_CHUNK = 64  # the chunk length of fla's varlen causal conv and gated delta rule (both their default)


@functools.lru_cache(maxsize=1)  # every layer of a pack, and its recompute, asks with the same lengths
def fla_chunk_indices(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """fla's varlen chunk table for samples of `lengths`: int32 (n_chunks, 2), one row (sample, chunk of that
    sample) per FLA_CHUNK-token chunk. fla's `prepare_chunk_indices` computes the same from the device cu_seqlens,
    with a `repeat_interleave` that syncs the host; here it comes from Python ints and is copied without blocking."""
    rows = [(sample, chunk) for sample, n in enumerate(lengths) for chunk in range(-(-n // FLA_CHUNK))]
    table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)
    if device.type == "cuda":
        table = table.pin_memory()
    return table.to(device, non_blocking=True)


def _fla_varlen_forward(
    module: torch.nn.Module, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, lengths: tuple[int, ...]
) -> torch.Tensor:
    """The layer's forward on a flat pack of samples of `lengths` (`cu_seqlens` on the device) with fla's varlen
    conv and delta rule. (1, T, hidden) → (1, T, hidden).

    Mirrors transformers' Qwen3_5GatedDeltaNet.forward (no cache); fla takes channels-last (1, T, C) for the conv
    and (1, T, heads, dim) for the delta rule, and keeps grouped value heads itself.
    """
    from fla.modules.convolution import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    _, seq_len, _ = hidden_states.shape
    chunk_indices = fla_chunk_indices(lengths, hidden_states.device)
    mixed_qkv, _ = causal_conv1d(
        module.in_proj_qkv(hidden_states),
        weight=module.conv1d.weight.squeeze(1),
        bias=module.conv1d.bias,
        activation=module.activation,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,  # the conv chunks by FLA_CHUNK, its fixed default
    )
    query, key, value = mixed_qkv.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(1, seq_len, -1, module.head_k_dim)
    key = key.reshape(1, seq_len, -1, module.head_k_dim)
    value = value.reshape(1, seq_len, -1, module.head_v_dim)
    beta = module.in_proj_b(hidden_states).sigmoid()
    g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(hidden_states).float() + module.dt_bias)
    core, _ = chunk_gated_delta_rule(
        query,
        key,
        value,
        g=g,
        beta=beta,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        chunk_size=FLA_CHUNK,
        use_qk_l2norm_in_kernel=True,
    )
    z = module.in_proj_z(hidden_states).reshape(-1, module.head_v_dim)
    core = module.norm(core.reshape(-1, module.head_v_dim), z).reshape(1, seq_len, -1)
    return module.out_proj(core)


def _context_parallel_forward(
    whole_pack_forward: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
    shard: context_parallel.ContextShard,
) -> torch.Tensor:
    """This rank's rows of `whole_pack_forward` run on the whole padded pack. (1, T_local, hidden) → (1, T_local,
    hidden).

    The input is all-gathered over the context group (rank-major), put in padded-pack order by `gather_order` and
    given to `whole_pack_forward` ((1, Tp, hidden) → (1, Tp, hidden), restarting at the padded documents'
    boundaries); `local_index` keeps this rank's rows. Every rank computes the whole layer, but a rank's gradient
    reaches the parameters only through its own rows, and backward of the gather returns the gradient of each input
    row, summed over the ranks, to the rank that owns it: the group's summed gradients are the whole pack's.
    """
    if hidden_states.shape[1] != shard.local_index.shape[0]:
        raise ValueError(
            f"the context shard has {shard.local_index.shape[0]} tokens, the layer got {hidden_states.shape[1]}."
        )
    gathered = context_parallel.gather_sequence(hidden_states[0], shard.group)
    whole = whole_pack_forward(gathered.index_select(0, shard.gather_order).unsqueeze(0))
    return whole[0].index_select(0, shard.local_index).unsqueeze(0)


def packed_gated_delta_forward(
    module: torch.nn.Module,
    pack_kwarg: str,
    backend: Literal["torch", "fla"],
    hidden_states: torch.Tensor,
    cache_params=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """Gated DeltaNet forward that restarts conv and recurrent state at every sample of a pack.

    hidden_states (1, T, hidden) with kwargs[pack_kwarg] (a modeling.packed.PackedSeqlens) → (1, T, hidden); with a
    modeling.context_parallel.ContextShard instead, this rank's (1, T_local, hidden) → (1, T_local, hidden), computed
    on the whole padded pack (`_context_parallel_forward`).
    Without a pack, the fla backend runs one unpadded sequence (batch 1, no mask, no cache) through the same fla
    kernels as a pack of one sample, so per-sample and packed training differ only in their boundaries (transformers'
    own forward would convolve with torch); anything else (padded batches, a cache, the torch backend) is the layer's
    original forward. Calls that compute in fp32 take the torch path under either backend (FP32_REASON).
    """
    original = getattr(module, ORIGINAL_FORWARD_ATTR)
    pack = kwargs.pop(pack_kwarg, None)
    if backend == "fla" and _computes_in_fp32(hidden_states):
        backend = "torch"  # e.g. the fp32 copy of a bf16 model that checks packing: FP32_REASON
    if pack is None:
        if backend == "fla" and cache_params is None and attention_mask is None and hidden_states.shape[0] == 1:
            whole = torch.tensor([0, hidden_states.shape[1]], dtype=torch.int32, device=hidden_states.device)
            return _fla_varlen_forward(module, hidden_states, whole, (hidden_states.shape[1],))
        return original(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
    if cache_params is not None:
        raise ValueError("packed Gated DeltaNet runs without a cache: call the model with use_cache=False.")
    if attention_mask is not None:
        raise ValueError("a packed batch has no padding mask; pass either packed_seqlens or attention_mask.")
    for flat_boundaries in ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"):
        kwargs.pop(flat_boundaries, None)  # the pack's lengths carry the boundaries here
    if isinstance(pack, context_parallel.ContextShard):
        if backend == "fla":
            whole_pack = functools.partial(
                _fla_varlen_forward, module, cu_seqlens=pack.padded_cu_seqlens, lengths=pack.padded_lengths
            )
        else:
            whole_pack = functools.partial(_forward_as_rows, original, lengths=pack.padded_lengths, **kwargs)
        return _context_parallel_forward(whole_pack, hidden_states, pack)
    if pack.total_tokens != hidden_states.shape[1]:
        raise ValueError(f"packed_seqlens covers {pack.total_tokens} tokens, the layer got {hidden_states.shape[1]}.")
    if backend == "fla":
        return _fla_varlen_forward(module, hidden_states, pack.cu_seqlens, pack.sample_lengths)
    return _forward_as_rows(original, hidden_states, pack.sample_lengths, **kwargs)


def _force_torch_delta_rule(modeling_name: str) -> None:
    """Make the modeling module call transformers' own torch delta rule (refcounted over patched models)."""
    modeling = sys.modules[modeling_name]
    original, count = _forced_torch_rule.get(modeling_name, (getattr(modeling, _DELTA_RULE), 0))
    setattr(modeling, _DELTA_RULE, inspect.unwrap(original))
    _forced_torch_rule[modeling_name] = (original, count + 1)


def _release_torch_delta_rule(modeling_name: str) -> None:
    original, count = _forced_torch_rule.pop(modeling_name)
    if count > 1:
        _forced_torch_rule[modeling_name] = (original, count - 1)
    else:
        setattr(sys.modules[modeling_name], _DELTA_RULE, original)


FLA_FIRST_RUN_NOTE = (
    "Gated DeltaNet: fla's kernels compile and autotune when first used on this machine, in the first steps: minutes "
    "on an empty Triton cache, seconds once Triton's cache (TRITON_CACHE_DIR, default ~/.triton/cache) holds them"
)


def patch_gated_delta_layers(
    model: torch.nn.Module, pack_kwarg: str, backend: Backend = "auto", compute_dtype: torch.dtype | None = None
) -> str | None:
    """Wrap every Gated DeltaNet layer's forward with `packed_gated_delta_forward`, reading the pack from the
    keyword `pack_kwarg`. Returns the backend used ("torch" or "fla"), or None for models without such layers.

    compute_dtype: the dtype the layers compute in (the autocast dtype; default the parameters'), which fla's
    self-check uses. Logs the backend and why once. Raises ValueError if a layer is already wrapped or the requested
    backend cannot train here.
    """
    layers = gated_delta_layers(model)
    if not layers:
        return None
    if any(hasattr(layer, ORIGINAL_FORWARD_ATTR) for layer in layers):
        raise ValueError("this model's Gated DeltaNet layers are already patched for packed batches.")
    dtype = compute_dtype or next(layers[0].parameters()).dtype
    choice = resolve_backend(backend, {GatedDeltaDims.of(layer) for layer in layers}, dtype)
    log.info("Gated DeltaNet: %s backend (%s)", choice.backend, choice.reason)
    if choice.backend == "fla":
        log.info(FLA_FIRST_RUN_NOTE)
    modeling_names = sorted({type(layer).__module__ for layer in layers})
    for name in modeling_names:  # the layers' own forward (padded batches, fp32 calls) stays transformers' torch math
        _force_torch_delta_rule(name)
    for layer in layers:
        setattr(layer, ORIGINAL_FORWARD_ATTR, layer.forward)
        layer.forward = functools.partial(packed_gated_delta_forward, layer, pack_kwarg, choice.backend)
    model._packed_gated_delta = modeling_names
    return choice.backend


def unpatch_gated_delta_layers(model: torch.nn.Module) -> None:
    """Restore the original forward of every wrapped Gated DeltaNet layer (and the delta rule it forced)."""
    modeling_names = getattr(model, "_packed_gated_delta", None) or []
    for layer in gated_delta_layers(model):
        if hasattr(layer, ORIGINAL_FORWARD_ATTR):
            del layer.forward
            delattr(layer, ORIGINAL_FORWARD_ATTR)
    for name in modeling_names:
        _release_torch_delta_rule(name)
    model._packed_gated_delta = None
