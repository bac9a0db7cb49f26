"""Packed (THD) forward: every sample of a pack sees exactly what it would see alone.

Mechanism (the same on transformers 5.17 and 5.23):

- Text attention. `packed_model_inputs` adds one keyword, `packed_seqlens` (a `PackedSeqlens`: the collator's
  `cu_seqlens` on the model's device, `max_seqlen` and the sample lengths as Python ints). The model forwards
  unknown keywords unchanged down to every decoder layer and into the attention function, and gradient
  checkpointing replays them, so the boundaries computed once per batch by the collator reach every layer with no
  per-layer derivation and no device sync. The name `packed_seqlens` collides with nothing transformers reads,
  unlike the top-level `cu_seq_lens_*` keywords 5.17 leaks into the vision encoder.
- Vision attention. The tower takes its per-image (and, for Qwen2.5-VL, per-window) boundaries from the host-side
  plan of modeling/vision_plan.py (TrainModule), or else derives them from `image_grid_thw` once per forward. Our
  implementation name contains "flash", so each vision block makes one call with them (`cu_seq_lens_q`,
  `max_length_q`) instead of one call per image; the attention function uses those and ignores the text pack.
- Mask. The registered mask function is sdpa's, and a forward pre-hook drops row 0 (text positions) of packed
  `position_ids`: transformers then sees no packing to detect (no O(T²) mask, no sync) and the mask is None. The
  hook sits on the base model (`model.model`), which receives the keywords unchanged both from the full model and
  from trainer/step.py, which calls it directly for the hidden states (its loss applies the lm_head itself).
  Without the hook (packing not enabled) row 0 stays, so a plain sdpa model still masks the pack correctly.
- Padded batches (no `packed_seqlens`) go through transformers' own sdpa with its padding mask: one model serves
  the packed run and the padded baseline.
- Qwen3.5 Gated DeltaNet layers: see modeling/gated_delta.py.

Kernels: on CUDA, with bf16/fp16 q/k/v or under a bf16/fp16 autocast (`varlen_dtype`) → one varlen call on the
engine `kernels.attention` chose (modeling/attention_engines.py: FlashAttention-4 where installed, on Hopper or
Blackwell, for head dims it computes exactly; else FlashAttention-2 through flash-attn or torch's varlen_attn);
otherwise (CPU, fp32) one SDPA call per segment, split by the host-side lengths. Inside a torch.compile trace
(modeling/compile.py) the host-side lengths are never read, so a graph fits packs of any shape: the varlen call
takes `cu_seqlens` and a symbolic `max_seqlen`, and the CPU / fp32 path becomes one SDPA call under a
block-diagonal mask built from `cu_seqlens` on the device.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from data.collate import VISION_INPUTS
from modeling import attention_engines, context_parallel, gated_delta

logger = logging.getLogger(__name__)

PACKED_ATTENTION = "packed_flash_varlen"
"""Registry name of the packed attention on the fa2 engine (`attention_name` gives each engine's). It contains
"flash" so vision blocks make one varlen call per layer; transformers refuses unknown "flash" names at load time, so
`enable_packed_forward` sets it after loading."""


def attention_name(engine: attention_engines.Engine) -> str:
    """The attention-registry name of the packed attention on `engine` (modeling/attention_engines.py)."""
    return PACKED_ATTENTION if engine == "fa2" else f"{PACKED_ATTENTION}_{engine}"


PACK_KWARG = "packed_seqlens"

_VARLEN_DTYPES = (torch.bfloat16, torch.float16)
VARLEN_DEVICES = ("cuda",)
"""Device types whose packed attention takes the varlen kernel (in a half dtype, `varlen_dtype`); elsewhere one SDPA
call per segment. verification/packing_check.py reads it to know which kernels a low-precision packed run takes."""


@dataclass(frozen=True)
class PackedSeqlens:
    """Sample boundaries of one pack, computed once per batch on the host.

    cu_seqlens: int32 (n+1,) on the model's device: 0, s₀, s₀+s₁, …, T.
    max_seqlen: longest sample, a Python int so no kernel syncs to read it.
    sample_lengths: (s₀, …, sₙ₋₁) as Python ints, for per-segment paths that split on the host.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    sample_lengths: tuple[int, ...]

    @property
    def total_tokens(self) -> int:
        return sum(self.sample_lengths)


def varlen_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scaling: float,
    causal: bool,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    engine: attention_engines.Engine = "fa2",
) -> torch.Tensor:
    """One varlen call on the GPU. q (Tq,H,D), k/v (Tk,Hkv,D) bf16/fp16 → (Tq,H,D).

    The key segments are the query segments (`cu_seqlens`) unless `cu_seqlens_k` / `max_seqlen_k` are given
    (context parallelism: a query chunk against its document's key prefix). Where a key segment is longer than its
    query segment, causal masking is aligned bottom-right — query i attends keys j <= i + seqlen_k - seqlen_q:
    flash-attn >= 2.1 documents it for `causal=True`, and torch's varlen_attn runs the same flash kernel
    (`aten._flash_attention_forward`, whose `is_causal=True` "means lower right": torch/nn/attention/bias.py).
    `engine` (modeling/attention_engines.py) takes fa4 only for head dims it computes exactly, fa2 otherwise.
    """
    cu_seqlens = cu_seqlens.to(device=query.device, dtype=torch.int32, non_blocking=True)
    cu_seqlens_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k.to(device=query.device, dtype=torch.int32)
    max_seqlen_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
    engine = attention_engines.engine_for_head_dim(engine, query.shape[-1])
    return attention_engines.varlen_attention(
        engine, query, key, value, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, scaling, causal
    )


def varlen_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.dtype | None:
    """The half dtype a varlen kernel computes q/k/v (any float dtypes) in, or None when it cannot.

    Under autocast it is autocast's dtype, the one SDPA would cast to: with fp32 master weights, models whose
    q/k pass an RMSNorm that multiplies by the fp32 weight (Qwen3-VL, Qwen3-VL-MoE) bring fp32 q/k beside a bf16 v,
    and must not fall back to one SDPA call per sample. Without autocast, q, k and v must share a half dtype.
    """
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return dtype if dtype in _VARLEN_DTYPES else None
    same = query.dtype == key.dtype == value.dtype
    return query.dtype if same and query.dtype in _VARLEN_DTYPES else None


def _shares_kv_heads(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether q (…, H, T, D) has more heads than k (GQA). A Python bool also where a trace holds the head counts
    as symbols (FSDP2's parameters under torch.compile): SDPA's `enable_gqa` takes no symbolic bool."""
    if query.shape[1] != key.shape[1]:  # noqa: SIM103 (a branch, so a trace decides it and guards on it)
        return True
    return False


def per_segment_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: list[int] | tuple[int, ...],
    scaling: float,
    causal: bool,
) -> torch.Tensor:
    """One SDPA call per segment. q (1,H,T,D), k/v (1,Hkv,T,D), any dtype → (T,H,D)."""
    gqa = _shares_kv_heads(query, key)
    outputs = [
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(*(t.split(list(lengths), dim=2) for t in (query, key, value)))
    ]
    return torch.cat(outputs, dim=2)[0].transpose(0, 1)


def _masked_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scaling: float, causal: bool
) -> torch.Tensor:
    """One SDPA call under a block-diagonal (and, if causal, lower-triangular) boolean mask built on the device
    from `cu_seqlens`. q (1,H,T,D), k/v (1,Hkv,T,D), any dtype → (T,H,D).

    The traced stand-in for `per_segment_sdpa`: its graph depends on no host-side length, so packs of other
    lengths and sample counts reuse it (torch.compile, modeling/compile.py). O(T²) mask: a CPU / fp32 path only.
    """
    tokens = torch.arange(query.shape[2], device=query.device)
    # Boundaries at or before each token: the sample index + 1. No slice of cu_seqlens, whose size would then
    # specialize the graph to packs of one sample or of several.
    segment = (tokens[:, None] >= cu_seqlens.to(query.device)).sum(-1)
    mask = segment[:, None] == segment[None, :]
    if causal:
        mask = mask & (tokens[:, None] >= tokens[None, :])
    gqa = _shares_kv_heads(query, key)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def _per_chunk_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_lengths: tuple[int, ...],
    k_lengths: tuple[int, ...],
    scaling: float,
) -> torch.Tensor:
    """One SDPA call per query chunk against its key segment, causal aligned bottom-right (query i attends keys
    j <= i + seqlen_k - seqlen_q) through an explicit mask: SDPA's `is_causal` aligns top-left.
    q (1,H,Tq,D), k/v (1,Hkv,Tk,D), any dtype → (Tq,H,D)."""
    gqa = query.shape[1] != key.shape[1]
    outputs = []
    for q, k, v in zip(query.split(list(q_lengths), dim=2), *(t.split(list(k_lengths), dim=2) for t in (key, value))):
        seqlen_q, seqlen_k = q.shape[2], k.shape[2]
        mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril(seqlen_k - seqlen_q)
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa))
    return torch.cat(outputs, dim=2)[0].transpose(0, 1)


def _context_parallel_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shard: context_parallel.ContextShard, scaling: float
) -> torch.Tensor:
    """Causal attention of this context rank's query chunks against their documents' key prefixes (all-gather-KV,
    modeling/context_parallel.py). q (1,H,T_local,D), k/v (1,Hkv,T_local,D) → (T_local,H,D).

    k and v are all-gathered over the context group (one collective when they share a dtype; on the varlen path in
    the half dtype the kernel computes in, which halves the traffic) and each chunk's key prefix is picked out with
    one index_select: a chunk at document offset o has keys [doc start, o + m), so bottom-right causal alignment
    gives query i the keys up to o + i.
    """
    half = varlen_dtype(query, key, value)
    varlen = query.device.type in VARLEN_DEVICES and half is not None
    if varlen:
        query, key, value = (t.to(half) for t in (query, key, value))
    k_local, v_local = (t[0].transpose(0, 1) for t in (key, value))
    if k_local.dtype == v_local.dtype:
        gathered = context_parallel.gather_sequence(torch.stack([k_local, v_local], dim=1), shard.group)
        k, v = gathered.index_select(0, shard.kv_index).unbind(1)
    else:
        k, v = (
            context_parallel.gather_sequence(t, shard.group).index_select(0, shard.kv_index) for t in (k_local, v_local)
        )
    if varlen:
        q = query[0].transpose(0, 1)
        return varlen_kernel(
            q, k, v, shard.cu_seqlens_q, shard.max_seqlen_q, scaling, True, shard.cu_seqlens_k, shard.max_seqlen_k
        )
    k, v = (t.transpose(0, 1)[None] for t in (k, v))
    return _per_chunk_sdpa(query, k, v, shard.q_lengths, shard.k_lengths, scaling)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    engine: attention_engines.Engine = "fa2",
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-registry entry: per-sample attention inside a pack, on the varlen `engine` where the
    GPU path applies (registered once per engine, `attention_name`).

    query (1,H,T,D), key/value (1,Hkv,T,D) (GQA heads not repeated) → (out (1,T,H,D), None).
    Vision calls bring their own `cu_seq_lens_q`/`max_length_q` and are bidirectional; text calls read the pack's
    `packed_seqlens` and are causal; calls with neither (padded batches) are transformers' sdpa.
    """
    pack: PackedSeqlens | None = kwargs.pop(PACK_KWARG, None)
    vision_cu_seqlens = kwargs.get("cu_seq_lens_q")
    if vision_cu_seqlens is None and pack is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if dropout > 0.0:
        raise ValueError(
            f"{PACKED_ATTENTION} has no attention dropout; set attention_dropout to 0 in the model config."
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{PACKED_ATTENTION} has no sliding-window attention; set use_sliding_window: false.")
    if query.shape[0] != 1:
        raise ValueError(f"a packed batch has batch size 1 (all samples in one row), got {query.shape[0]}.")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if vision_cu_seqlens is None and isinstance(pack, context_parallel.ContextShard):
        return _context_parallel_attention(query, key, value, pack, scaling).unsqueeze(0), None
    if vision_cu_seqlens is not None:
        causal, cu_seqlens, max_seqlen, lengths = False, vision_cu_seqlens, kwargs.get("max_length_q"), None
    else:
        causal, cu_seqlens, max_seqlen, lengths = True, pack.cu_seqlens, pack.max_seqlen, pack.sample_lengths
        # Under torch.compile the host lengths stay unread (packed_model_inputs checked them): reading them would
        # specialize the graph to this pack's lengths and recompile for the next.
        if not torch.compiler.is_compiling() and pack.total_tokens != query.shape[2]:
            raise ValueError(f"packed_seqlens covers {pack.total_tokens} tokens but the sequence has {query.shape[2]}.")

    half = varlen_dtype(query, key, value)
    if query.device.type in VARLEN_DEVICES and half is not None:
        if max_seqlen is None:  # only a vision tower that did not precompute it: one sync per call
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        q, k, v = (t[0].transpose(0, 1).to(half) for t in (query, key, value))
        out = varlen_kernel(q, k, v, cu_seqlens, max_seqlen, scaling, causal, engine=engine)
    elif torch.compiler.is_compiling():
        out = _masked_sdpa(query, key, value, cu_seqlens, scaling, causal)
    else:
        if lengths is None:  # vision boundaries are a tensor; on this (CPU or fp32) path a host copy is cheap
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        out = per_segment_sdpa(query, key, value, lengths, scaling, causal)
    return out.unsqueeze(0), None


def _enter_pack(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: for a packed call, drop the text-position row so transformers builds no packed mask."""
    position_ids = kwargs.get("position_ids")
    is_packed = kwargs.get(PACK_KWARG) is not None
    if is_packed and position_ids is not None and position_ids.dim() == 3 and position_ids.shape[0] == 4:
        kwargs["position_ids"] = position_ids[1:]
    return args, kwargs


@dataclass
class _PackedForwardState:
    hook: torch.utils.hooks.RemovableHandle
    previous_attn: dict[int, str | None]


def _configs(model: torch.nn.Module) -> list:
    """Every distinct config object of the model (top, text, vision and the modules' own references)."""
    seen: dict[int, object] = {}
    for sub in model.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


def register_packed_attention() -> None:
    """Register the attention function and its mask function (sdpa's) under each engine's `attention_name`.
    Idempotent."""
    for engine in attention_engines.ENGINES:
        name = attention_name(engine)
        function = packed_attention_forward if engine == "fa2" else partial(packed_attention_forward, engine=engine)
        AttentionInterface.register(name, function)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


def enable_packed_forward(
    model: torch.nn.Module,
    gated_delta_backend: gated_delta.Backend = "auto",
    compute_dtype: torch.dtype | None = None,
    attention_engine: attention_engines.Engine = "fa2",
) -> str | None:
    """Make `model` take packed batches: registers the varlen attention, sets it on every config (text and vision),
    installs the position pre-hook and, for Qwen3.5 families, the boundary-exact Gated DeltaNet forward.

    gated_delta_backend: "auto" (fla's varlen kernels where they can train, else the torch path), "torch" or "fla";
    compute_dtype: the dtype the model computes in under autocast (default its parameters'), for fla's self-check
    (modeling/gated_delta.py); attention_engine: the varlen engine of the GPU path (`kernels.attention` resolved by
    `attention_engines.resolve_engine`).
    Returns the Gated DeltaNet backend in use ("torch" / "fla"), None for models without such layers.
    Raises ValueError if already enabled or when the requested Gated DeltaNet backend cannot train here (with the
    reason and what to install), so a run fails before its first step instead of mixing samples.
    Undo with `disable_packed_forward(model)`.
    """
    if getattr(model, "_packed_forward_state", None) is not None:
        raise ValueError("packed forward is already enabled on this model.")
    register_packed_attention()
    backend = gated_delta.patch_gated_delta_layers(model, PACK_KWARG, gated_delta_backend, compute_dtype)
    configs = _configs(model)
    previous = {id(c): c._attn_implementation for c in configs}
    for config in configs:
        config._attn_implementation = attention_name(attention_engine)
    hook = model.model.register_forward_pre_hook(_enter_pack, with_kwargs=True)
    model._packed_forward_state = _PackedForwardState(hook=hook, previous_attn=previous)
    logger.info(
        "packed forward: %s on %d configs; Gated DeltaNet backend: %s",
        attention_name(attention_engine),
        len(configs),
        backend,
    )
    return backend


def disable_packed_forward(model: torch.nn.Module) -> None:
    """Undo `enable_packed_forward`: previous attention implementations, no hook, original Gated DeltaNet."""
    state: _PackedForwardState | None = getattr(model, "_packed_forward_state", None)
    if state is None:
        raise ValueError("packed forward is not enabled on this model.")
    state.hook.remove()
    for config in _configs(model):
        config._attn_implementation = state.previous_attn.get(id(config), config._attn_implementation)
    gated_delta.unpatch_gated_delta_layers(model)
    model._packed_forward_state = None


def is_packed_forward_enabled(model: torch.nn.Module) -> bool:
    return getattr(model, "_packed_forward_state", None) is not None


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Temporarily run every config of `model` with attention implementation `name` (e.g. "sdpa" for references)."""
    configs = _configs(model)
    previous = [c._attn_implementation for c in configs]
    for config in configs:
        config._attn_implementation = name
    try:
        yield
    finally:
        for config, old in zip(configs, previous):
            config._attn_implementation = old


MODEL_KEYS = ("input_ids", "position_ids", "mm_token_type_ids", *VISION_INPUTS)


def is_packed_batch(batch: dict) -> bool:
    """A packed batch (whole, or one context rank's shard of one), as opposed to a padded one."""
    return "cu_seqlens" in batch or context_parallel.is_sharded(batch)


def packed_model_inputs(model: torch.nn.Module, batch: dict) -> dict:
    """Keyword arguments for `model(**inputs, use_cache=False)` from a packed batch (docs/architecture.md).

    batch: input_ids long (1,T), position_ids long (4,1,T), mm_token_type_ids int (1,T), pixel_values
    (P, C·tp·p·p) or None, image_grid_thw long (n_images,3) or None, pixel_values_videos / video_grid_thw likewise
    for videos, cu_seqlens int32 (n+1,), max_seqlen int,
    sample_lengths list[int]; tensors already on the model's device except possibly cu_seqlens.
    Returns those model keys plus `packed_seqlens`; the model returns logits (1,T,V), its base model
    (`model.model`, given the same keywords) the last hidden states (1,T,H).
    Raises ValueError when the model was not prepared with `enable_packed_forward` (its samples would leak into
    each other) or when the batch's boundaries disagree with its shapes.
    """
    if not is_packed_forward_enabled(model):
        raise ValueError("call modeling.packed.enable_packed_forward(model) before feeding it packed batches.")
    if context_parallel.is_sharded(batch):
        return _context_parallel_inputs(model, batch)
    input_ids = batch["input_ids"]
    lengths = tuple(int(s) for s in batch["sample_lengths"])
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"packed input_ids must be (1, T), got {tuple(input_ids.shape)}.")
    if sum(lengths) != input_ids.shape[1] or min(lengths, default=0) < 1:
        raise ValueError(f"sample_lengths {lengths} must be positive and sum to T = {input_ids.shape[1]}.")
    if tuple(batch["cu_seqlens"].shape) != (len(lengths) + 1,):
        raise ValueError(f"cu_seqlens must have {len(lengths) + 1} entries, got {tuple(batch['cu_seqlens'].shape)}.")
    if batch["position_ids"].shape[0] != 4:
        raise ValueError("packed position_ids must be (4, 1, T): text row, then the per-sample mRoPE rows.")
    inputs = {key: batch[key] for key in MODEL_KEYS if batch.get(key) is not None}
    inputs[PACK_KWARG] = PackedSeqlens(
        cu_seqlens=batch["cu_seqlens"].to(device=input_ids.device, dtype=torch.int32, non_blocking=True),
        max_seqlen=int(batch["max_seqlen"]),
        sample_lengths=lengths,
    )
    return inputs


def _context_parallel_inputs(model: torch.nn.Module, batch: dict) -> dict:
    """Model keywords for a `context_parallel.shard_pack` batch: the whole padded pack's input_ids (the model
    embeds it), this rank's position_ids, and the ContextShard as `packed_seqlens`; no vision inputs (the caller
    adds `mm_encoder_outputs` from `context_parallel.vision_features`, the pack's features gathered over the
    group). Raises ValueError when the model has no context group (enable_context_parallel)."""
    group = context_parallel.context_group(model)
    if group is None:
        raise ValueError("a context-parallel batch needs modeling.context_parallel.enable_context_parallel(model).")
    local_tokens = batch["cp_local_index"].shape[0]
    if batch["position_ids"].shape != (4, 1, local_tokens) or batch["shift_labels"].shape != (1, local_tokens):
        raise ValueError(f"a context-parallel batch's positions and labels must cover its {local_tokens} tokens.")
    inputs = {key: batch[key] for key in MODEL_KEYS if batch.get(key) is not None and key not in VISION_INPUTS}
    inputs[PACK_KWARG] = context_parallel.context_shard(batch, group, batch["input_ids"].device)
    return inputs
