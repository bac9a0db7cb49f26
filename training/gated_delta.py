"""Boundary-exact Qwen3.5 Gated DeltaNet on packed batches.

The Gated DeltaNet layer carries a causal depthwise conv and a recurrent state along the sequence; in a pack both
must restart at every sample. transformers never infers these boundaries (5.17 mixes samples silently, 5.23 raises
without flash-linear-attention), so each layer's forward is wrapped here, with one of two backends:

- "fla": flash-linear-attention's varlen kernels get the pack's `cu_seqlens` explicitly —
  `fla.modules.convolution.causal_conv1d(x, …, cu_seqlens=…)` and
  `fla.ops.gated_delta_rule.chunk_gated_delta_rule(…, cu_seqlens=…)` — on the flat (1, T) pack, no padding.
  Used only where its backward works: CUDA, and not Hopper with Triton < 3.7.1 (there fla refuses the backward and
  asks for tilelang).
- "torch" (everywhere): the layer's own forward with every sample of the pack as its own row of a right-padded
  batch, one batch per power-of-two length class. Conv and delta rule are causal, so the padding after a sample
  never reaches its tokens and each row computes exactly what the sample computes alone. transformers' own torch
  delta rule is forced for the layers' module while this backend is on (transformers would otherwise pick fla
  when importable, whose backward may refuse). Boundaries come from the pack's host-side lengths: no sync.
  Cost: at most 2x the pack's tokens through the layer (64 at least per sample), a few batched calls per layer.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
from typing import Literal

import torch
import torch.nn.functional as F

Backend = Literal["auto", "torch", "fla"]
_PATCH_ATTR = "_packed_original_forward"
_DELTA_RULE = "torch_chunk_gated_delta_rule"  # the modeling modules' global that may dispatch to fla
_forced_torch_rule: dict[str, tuple[object, int]] = {}  # modeling module → (its original global, patched models)


def gated_delta_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's Gated DeltaNet modules (Qwen3_5GatedDeltaNet, Qwen3_5MoeGatedDeltaNet, …)."""
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def fla_unusable_reason() -> str | None:
    """Why fla's varlen Gated DeltaNet cannot train here (None when it can)."""
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention is not installed (pip install flash-linear-attention)"
    if not torch.cuda.is_available():
        return "fla's kernels need a CUDA device"
    import triton

    triton_version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:3])
    if torch.cuda.get_device_capability()[0] == 9 and triton_version < (3, 7, 1):
        return f"fla's backward refuses on Hopper with Triton {triton.__version__} < 3.7.1 (it asks for tilelang)"
    return None


def resolve_backend(backend: Backend) -> Literal["torch", "fla"]:
    """ "auto" → "fla" where it can train, else "torch"; "fla" raises ValueError with the reason when it cannot."""
    reason = fla_unusable_reason()
    if backend == "fla" and reason is not None:
        raise ValueError(f"Gated DeltaNet backend 'fla' requested but {reason}; use 'torch' or 'auto'.")
    if backend == "auto":
        return "fla" if reason is None else "torch"
    return backend


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


def _fla_varlen_forward(module: torch.nn.Module, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The layer's forward on a flat pack with fla's varlen conv and delta rule. (1, T, hidden) → (1, T, hidden).

    Mirrors transformers' Qwen3_5GatedDeltaNet.forward (no cache); fla takes channels-last (1, T, C) for the conv
    and (1, T, heads, dim) for the delta rule, and keeps grouped value heads itself.
    """
    from fla.modules.convolution import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    _, seq_len, _ = hidden_states.shape
    mixed_qkv, _ = causal_conv1d(
        module.in_proj_qkv(hidden_states),
        weight=module.conv1d.weight.squeeze(1),
        bias=module.conv1d.bias,
        activation=module.activation,
        cu_seqlens=cu_seqlens,
    )
    query, key, value = mixed_qkv.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(1, seq_len, -1, module.head_k_dim)
    key = key.reshape(1, seq_len, -1, module.head_k_dim)
    value = value.reshape(1, seq_len, -1, module.head_v_dim)
    beta = module.in_proj_b(hidden_states).sigmoid()
    g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(hidden_states).float() + module.dt_bias)
    core, _ = chunk_gated_delta_rule(
        query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True
    )
    z = module.in_proj_z(hidden_states).reshape(-1, module.head_v_dim)
    core = module.norm(core.reshape(-1, module.head_v_dim), z).reshape(1, seq_len, -1)
    return module.out_proj(core)


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

    hidden_states (1, T, hidden) with kwargs[pack_kwarg] (a training.packed.PackedSeqlens) → (1, T, hidden).
    Without a pack (per-sample or padded batches) this is the layer's original forward.
    """
    original = getattr(module, _PATCH_ATTR)
    pack = kwargs.pop(pack_kwarg, None)
    if pack is None:
        return original(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
    if cache_params is not None:
        raise ValueError("packed Gated DeltaNet runs without a cache: call the model with use_cache=False.")
    if attention_mask is not None:
        raise ValueError("a packed batch has no padding mask; pass either packed_seqlens or attention_mask.")
    if pack.total_tokens != hidden_states.shape[1]:
        raise ValueError(f"packed_seqlens covers {pack.total_tokens} tokens, the layer got {hidden_states.shape[1]}.")
    if backend == "fla":
        return _fla_varlen_forward(module, hidden_states, pack.cu_seqlens)
    for flat_boundaries in ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"):
        kwargs.pop(flat_boundaries, None)  # rows carry the boundaries here
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


def patch_gated_delta_layers(model: torch.nn.Module, pack_kwarg: str, backend: Backend = "auto") -> str | None:
    """Wrap every Gated DeltaNet layer's forward with `packed_gated_delta_forward`, reading the pack from the
    keyword `pack_kwarg`. Returns the backend used ("torch" or "fla"), or None for models without such layers.

    Raises ValueError if a layer is already wrapped or the requested backend cannot train here.
    """
    layers = gated_delta_layers(model)
    if not layers:
        return None
    if any(hasattr(layer, _PATCH_ATTR) for layer in layers):
        raise ValueError("this model's Gated DeltaNet layers are already patched for packed batches.")
    chosen = resolve_backend(backend)
    modeling_names = sorted({type(layer).__module__ for layer in layers})
    if chosen == "torch":
        for name in modeling_names:
            _force_torch_delta_rule(name)
    for layer in layers:
        setattr(layer, _PATCH_ATTR, layer.forward)
        layer.forward = functools.partial(packed_gated_delta_forward, layer, pack_kwarg, chosen)
    model._packed_gated_delta = (chosen, modeling_names)
    return chosen


def unpatch_gated_delta_layers(model: torch.nn.Module) -> None:
    """Restore the original forward of every wrapped Gated DeltaNet layer (and the delta rule it forced)."""
    chosen, modeling_names = getattr(model, "_packed_gated_delta", None) or (None, [])
    for layer in gated_delta_layers(model):
        if hasattr(layer, _PATCH_ATTR):
            del layer.forward
            delattr(layer, _PATCH_ATTR)
    if chosen == "torch":
        for name in modeling_names:
            _release_torch_delta_rule(name)
    model._packed_gated_delta = None
