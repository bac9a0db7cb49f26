"""Context parallelism (`parallel.context` = CP > 1): one pack split over CP ranks, trained exactly
(docs/context-parallel.md has the design and its costs).

Layout. Ranks are grouped in consecutive blocks of CP (ranks d·CP … d·CP+CP-1 form context group d, on one host
when CP divides the GPUs per host): every rank of a group gets the same pack from the StepLoader, which deals by
data-parallel rank `rank // CP` over `world_size // CP` data-parallel ranks.

Sharding (`shard_pack`, on the host, once per batch). Each document (sample) of the pack is padded at its end to a
multiple of 2·CP and cut into 2·CP equal chunks; context rank r takes chunks r and 2·CP-1-r of every document
(zig-zag, as Megatron and Transformer Engine do), so every rank holds the same number of tokens and about the
same causal attention work. Padding instead of uneven chunks keeps every rank's shard the same length, which the
all-gather needs; the pad tokens carry IGNORE_INDEX labels and sit after the document's last token, so causally no
real token attends to them and they change no loss or gradient. Positions (all four rows), labels and the
attention boundaries travel with the tokens.

Attention (`modeling/packed.py`): all-gather-KV. Each rank computes q, k, v for its tokens, `gather_sequence`
all-gathers k and v over the context group (backward reduce-scatters dk, dv), and one index_select puts, for each
local query chunk, its document's key prefix next to it: a chunk at document offset o attends keys [doc start,
o + i] — causal with the mask aligned bottom-right, which is what the varlen kernels do for seqlen_q < seqlen_k.

Vision (`vision_features`). Each image (and video) is encoded by one context rank only, dealt by patch count
(`deal_by_patches`); the merged tokens (and Qwen3-VL's deepstack features) are all-gathered over the group and handed to
the model as its precomputed `mm_encoder_outputs`, in pack order; backward returns each rank's gradient of a feature to
the rank that computed it. A rank that owns no image (video) of a pack that has some runs a dummy image in its place, so
every rank makes the same vision calls and collectives.

Model. The model embeds the whole (padded) pack and scatters the gathered features into it; a pre-hook on the
language model keeps this rank's tokens of the embeddings (and of the deepstack features) before the first decoder
layer. The logits and the loss are this rank's tokens only.

Gradients. Each rank's loss is the summed CE of its tokens; step.accumulate_gradients divides by the label count
summed over all ranks and multiplies by the world size, and DDP/FSDP average over all ranks: the result is the
sum over context ranks (each holds its tokens' share of every parameter's gradient) averaged over data-parallel
ranks, i.e. the gradient of the global batch's mean token loss.

Gated DeltaNet (Qwen3.5, `modeling/gated_delta.py`): all-gather the layer's input. Its causal conv and recurrent
state run along each whole document, so a layer all-gathers its input hidden states over the group
(`gather_sequence`), puts them in padded-pack order (`ContextShard.gather_order`), runs its boundary-exact forward
on the whole padded pack (`padded_lengths` / `padded_cu_seqlens`: each document with its pads at its end, which
being causal and last change no real token) and keeps this rank's rows (`local_index`). Exact, but every rank
computes (and keeps the activations of) the whole pack's Gated DeltaNet layers: those layers do not shrink with
CP; attention layers, MLPs and the loss do. A rank's gradient of the layer's parameters comes from its own output
rows only, and backward of the gather sends every rank's gradient of each input row back to the rank that owns it,
so the context group's summed gradients are the single-process ones, as for attention.

Not supported: padded (non-packed) batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from core.config_tree import ConfigError
from data.collate import TEXT, label_rows
from data.processing import IGNORE_INDEX

VISION_KINDS = (("image", "pixel_values"), ("video", "pixel_values_videos"))


@dataclass(frozen=True)
class ContextLayout:
    """Where a rank sits: its data-parallel rank among `data_size`, its context rank among `context_size`."""

    data_rank: int
    data_size: int
    context_rank: int
    context_size: int


def layout(rank: int, world_size: int, context_size: int) -> ContextLayout:
    """The layout of `rank` in a world of `world_size` ranks with context groups of `context_size` consecutive
    ranks. Raises ConfigError when the world does not split into whole groups."""
    if context_size < 1:
        raise ConfigError(f"parallel.context must be >= 1, got {context_size}.")
    if world_size % context_size:
        raise ConfigError(
            f"parallel.context={context_size} does not divide the {world_size} launched processes: launch a multiple "
            f"of {context_size} processes (accelerate launch --num_processes) or change parallel.context."
        )
    return ContextLayout(rank // context_size, world_size // context_size, rank % context_size, context_size)


def new_context_group(world_size: int, context_size: int) -> dist.ProcessGroup:
    """This rank's context group. Every rank creates every group (torch requires it), in the same order."""
    rank, mine = dist.get_rank(), None
    for first in range(0, world_size, context_size):
        group = dist.new_group(list(range(first, first + context_size)))
        if first <= rank < first + context_size:
            mine = group
    return mine


@dataclass(frozen=True)
class ContextShard:
    """What the attention and the language-model hook need for one sharded pack, on the model's device.

    group: the context group. local_index: long (T_local,), this rank's tokens' positions in the padded pack.
    kv_index: long (ΣK,), for each local query chunk, its document's key prefix as rows of the all-gathered
    (rank-major) keys. cu_seqlens_q / cu_seqlens_k: int32 (2n+1,), the query chunks and their key prefixes.
    max_seqlen_q / max_seqlen_k: Python ints. q_lengths / k_lengths: the same boundaries as Python ints for the
    per-segment path. visual_rows: long (V_local,), for this rank's vision tokens in order, their row in the
    pack's vision features (Qwen3-VL deepstack).
    For Gated DeltaNet layers (whole padded pack): gather_order: long (Tp,), for each position of the padded pack,
    its row in the all-gathered (rank-major) tensor. padded_cu_seqlens: int32 (n+1,), the padded documents'
    boundaries; padded_lengths: their lengths as Python ints.
    """

    group: dist.ProcessGroup
    local_index: torch.Tensor
    kv_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    q_lengths: tuple[int, ...]
    k_lengths: tuple[int, ...]
    visual_rows: torch.Tensor
    gather_order: torch.Tensor
    padded_cu_seqlens: torch.Tensor
    padded_lengths: tuple[int, ...]


def zigzag_indices(lengths: list[int], context_size: int) -> tuple[list[int], list[np.ndarray]]:
    """Padded document lengths and, per context rank, the positions of its tokens in the padded pack.

    Document d of length L is padded to Lp = ⌈L / 2CP⌉·2CP and cut into 2CP chunks of m = Lp / 2CP; rank r takes
    chunk r, then chunk 2CP-1-r, document after document. Returns (padded lengths, [int64 (Σ Lp / CP,)] per rank).
    """
    chunks = 2 * context_size
    padded = [-(-length // chunks) * chunks for length in lengths]
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64)
    per_rank = []
    for r in range(context_size):
        parts = []
        for start, length in zip(starts, padded):
            m = length // chunks
            for c in (r, chunks - 1 - r):
                parts.append(np.arange(start + c * m, start + (c + 1) * m, dtype=np.int64))
        per_rank.append(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
    return padded, per_rank


def _pad_documents(array: np.ndarray, lengths: list[int], padded: list[int], fill) -> np.ndarray:
    """array (..., T) → (..., Σ padded): each document's pad columns appended after it, from `fill(doc, count)`."""
    parts, start = [], 0
    for length, target in zip(lengths, padded):
        parts.append(array[..., start : start + length])
        if target > length:
            parts.append(fill(array[..., start : start + length], target - length))
        start += length
    return np.concatenate(parts, axis=-1)


def shard_pack(batch: dict, context_rank: int, context_size: int, pad_token_id: int, spatial_merge_size: int) -> dict:
    """This context rank's share of a packed host batch (data/collate.py's `Collator.packed`).

    Kept whole (the model embeds the whole pack): input_ids (1, Tp) and mm_token_type_ids (1, Tp), documents padded
    with `pad_token_id` text tokens; image_grid_thw / video_grid_thw (every image and video of the pack).
    Sharded (T_local = Tp / CP): position_ids (4, 1, T_local), shift_labels (1, T_local) (IGNORE_INDEX on pads),
    label_rows (this rank's labelled rows, data/collate.py's `label_rows`).
    Vision: each image (video) goes to the context rank `deal_by_patches` picks: pixel_values / pixel_values_videos hold
    this rank's patches only (None when it has none), cp_image_grid_thw / cp_video_grid_thw their grids, and
    cp_image_rows / cp_video_rows (long) and cp_image_width / cp_video_width (int) say where each merged token of the
    pack's images lies in the gathered features (`vision_features`); those keys exist only for a kind the pack has.
    Added: cp_local_index, cp_kv_index (long), cp_cu_seqlens_q / cp_cu_seqlens_k (int32), cp_max_seqlen_q /
    cp_max_seqlen_k, cp_q_lengths / cp_k_lengths (Python ints), cp_visual_rows (long), cp_gather_order (long (Tp,)),
    cp_padded_cu_seqlens (int32) and cp_padded_lengths (Python ints), context_rank.
    num_label_tokens is this rank's and cp_pack_label_tokens the pack's; the other counts (tokens, patches,
    sample_lengths) stay the pack's, and the metrics count them on context rank 0 only. seq_idx and the whole-pack
    cu_seqlens / max_seqlen are dropped.
    `spatial_merge_size`: the vision config's (patches per merged token = its square).
    """
    lengths = [int(s) for s in batch["sample_lengths"]]
    chunks = 2 * context_size
    padded, per_rank = zigzag_indices(lengths, context_size)
    local = per_rank[context_rank]

    def pad_with(value):
        return lambda doc, count: np.full((*doc.shape[:-1], count), value, dtype=doc.dtype)

    def continue_positions(doc, count):  # pads count on from the document's last position (never attended to)
        return doc[..., -1:] + np.arange(1, count + 1, dtype=doc.dtype)

    input_ids = _pad_documents(batch["input_ids"].numpy(), lengths, padded, pad_with(pad_token_id))
    token_types = _pad_documents(batch["mm_token_type_ids"].numpy(), lengths, padded, pad_with(TEXT))
    shift_labels = _pad_documents(batch["shift_labels"].numpy(), lengths, padded, pad_with(IGNORE_INDEX))
    positions = _pad_documents(batch["position_ids"].numpy(), lengths, padded, continue_positions)

    # Rows of the all-gathered tensors (rank s's local token j is row s·T_local + j) for each padded-pack position:
    # the keys' prefixes below, and the whole padded pack of a Gated DeltaNet layer (cp_gather_order).
    gathered_row = np.empty(sum(padded), dtype=np.int64)
    for s, index in enumerate(per_rank):
        gathered_row[index] = s * len(index) + np.arange(len(index))
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]]).astype(np.int64)
    q_lengths, k_lengths, kv_parts = [], [], []
    for start, length in zip(starts, padded):
        m = length // chunks
        for c in (context_rank, chunks - 1 - context_rank):
            q_lengths.append(m)
            k_lengths.append((c + 1) * m)
            kv_parts.append(gathered_row[start : start + (c + 1) * m])
    is_visual = token_types[0] != TEXT
    visual_rank = np.cumsum(is_visual) - 1
    visual_rows = visual_rank[local][is_visual[local]]
    local_labels = shift_labels[:, local]

    sharded = {k: v for k, v in batch.items() if k not in ("seq_idx", "cu_seqlens", "max_seqlen")}
    sharded.update(
        input_ids=torch.from_numpy(input_ids),
        mm_token_type_ids=torch.from_numpy(token_types),
        position_ids=torch.from_numpy(np.ascontiguousarray(positions[..., local])),
        shift_labels=torch.from_numpy(np.ascontiguousarray(local_labels)),
        label_rows=label_rows(local_labels),
        cp_local_index=torch.from_numpy(local),
        cp_kv_index=torch.from_numpy(np.concatenate(kv_parts)),
        cp_cu_seqlens_q=torch.from_numpy(np.concatenate([[0], np.cumsum(q_lengths)]).astype(np.int32)),
        cp_cu_seqlens_k=torch.from_numpy(np.concatenate([[0], np.cumsum(k_lengths)]).astype(np.int32)),
        cp_max_seqlen_q=max(q_lengths),
        cp_max_seqlen_k=max(k_lengths),
        cp_q_lengths=q_lengths,
        cp_k_lengths=k_lengths,
        cp_visual_rows=torch.from_numpy(np.ascontiguousarray(visual_rows)),
        cp_gather_order=torch.from_numpy(gathered_row),
        cp_padded_cu_seqlens=torch.from_numpy(np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)),
        cp_padded_lengths=padded,
        context_rank=context_rank,
        num_label_tokens=int((local_labels != IGNORE_INDEX).sum()),
        cp_pack_label_tokens=int((shift_labels != IGNORE_INDEX).sum()),
    )
    for kind, pixel_key in VISION_KINDS:
        if batch.get(f"{kind}_grid_thw") is not None:
            sharded.update(_shard_vision(batch, kind, pixel_key, context_rank, context_size, spatial_merge_size))
    return sharded


def deal_by_patches(patches: list[int], context_size: int) -> list[int]:
    """The context rank that encodes each image (video): largest first, each to the rank with the fewest patches so
    far (ties to the lower rank), so the ranks' vision work stays even when image sizes differ (dealing by count can
    give one rank most of the large images; the other then waits at the feature all-gather). Every rank computes
    the same deal from the pack alone."""
    load, owner = [0] * context_size, [0] * len(patches)
    for item in sorted(range(len(patches)), key=lambda i: -patches[i]):
        owner[item] = min(range(context_size), key=lambda rank: load[rank])
        load[owner[item]] += patches[item]
    return owner


def _shard_vision(batch: dict, kind: str, pixel_key: str, context_rank: int, context_size: int, merge: int) -> dict:
    """This rank's images (or videos) as `deal_by_patches` deals them, in pack order, and the gathered-feature rows
    of every merged token of the pack's items in pack order (rank s's local row j is row s·width + j of the
    gather)."""
    grid = batch[f"{kind}_grid_thw"]
    patches = grid.prod(-1).tolist()
    merged = [p // merge**2 for p in patches]
    owner = deal_by_patches(patches, context_size)
    patch_starts = np.concatenate([[0], np.cumsum(patches)]).astype(np.int64)
    local_offset, counts, rows = [], [0] * context_size, []
    for i, s in enumerate(owner):
        local_offset.append(counts[s])
        counts[s] += merged[i]
    width = max(counts)
    for i, s in enumerate(owner):
        rows.append(s * width + local_offset[i] + np.arange(merged[i], dtype=np.int64))
    mine = [i for i, s in enumerate(owner) if s == context_rank]
    pixel_rows = [np.arange(patch_starts[i], patch_starts[i + 1], dtype=np.int64) for i in mine]
    return {
        pixel_key: batch[pixel_key][torch.from_numpy(np.concatenate(pixel_rows))] if mine else None,
        f"cp_{kind}_grid_thw": grid[mine] if mine else None,
        f"cp_{kind}_rows": torch.from_numpy(np.concatenate(rows)),
        f"cp_{kind}_width": width,
    }


def is_sharded(batch: dict) -> bool:
    return "cp_kv_index" in batch


def context_shard(batch: dict, group: dist.ProcessGroup, device: torch.device) -> ContextShard:
    """The ContextShard of a `shard_pack` batch (its tensors already on `device`, or copied there without a
    host wait)."""

    def on_device(key: str, dtype: torch.dtype) -> torch.Tensor:
        return batch[key].to(device=device, dtype=dtype, non_blocking=True)

    return ContextShard(
        group=group,
        local_index=on_device("cp_local_index", torch.long),
        kv_index=on_device("cp_kv_index", torch.long),
        cu_seqlens_q=on_device("cp_cu_seqlens_q", torch.int32),
        cu_seqlens_k=on_device("cp_cu_seqlens_k", torch.int32),
        max_seqlen_q=int(batch["cp_max_seqlen_q"]),
        max_seqlen_k=int(batch["cp_max_seqlen_k"]),
        q_lengths=tuple(int(x) for x in batch["cp_q_lengths"]),
        k_lengths=tuple(int(x) for x in batch["cp_k_lengths"]),
        visual_rows=on_device("cp_visual_rows", torch.long),
        gather_order=on_device("cp_gather_order", torch.long),
        padded_cu_seqlens=on_device("cp_padded_cu_seqlens", torch.int32),
        padded_lengths=tuple(int(x) for x in batch["cp_padded_lengths"]),
    )


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward sums the gradients of every rank's copy (reduce-scatter)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        local = local.contiguous()
        size = dist.get_world_size(group)
        if dist.get_backend(group) == dist.Backend.NCCL:
            out = local.new_empty((size * local.shape[0], *local.shape[1:]))
            dist.all_gather_into_tensor(out, local, group=group)
            return out
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == dist.Backend.NCCL:
            out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        dist.all_reduce(grad, group=group)  # gloo has no reduce-scatter
        return grad.chunk(size)[rank].clone(), None


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(T_local, ...) on each rank of `group` → (size·T_local, ...), rank-major; differentiable (backward sums
    every rank's gradient of this rank's rows)."""
    return _GatherSequence.apply(local, group)


def has_vision(batch: dict, pixel_key: str) -> bool:
    """Whether the pack (whole, or sharded: any rank's share) has images (`pixel_values`) or videos."""
    kind = {key: kind for kind, key in VISION_KINDS}[pixel_key]
    return batch.get(pixel_key) is not None or batch.get(f"cp_{kind}_rows") is not None


@dataclass
class GatheredVision:
    """The vision tower's output for every image (video) of the pack, as the model's forward reads a precomputed
    `mm_encoder_outputs` entry: pooler_output (merged tokens (N, D),) and, for Qwen3-VL, deepstack_features
    [(N, D),] per deepstack layer."""

    pooler_output: tuple[torch.Tensor, ...]
    deepstack_features: list[tuple[torch.Tensor, ...]] | None = None


def vision_features(
    model: torch.nn.Module, batch: dict, dummy_pixels: torch.Tensor, dummy_grid: torch.Tensor
) -> dict[str, GatheredVision]:
    """`mm_encoder_outputs` for a `shard_pack` batch: each rank runs the vision tower on its own images and videos,
    and the merged tokens (with the deepstack features, stacked: one collective per kind) are all-gathered over the
    context group and put in pack order. Backward sends every rank's gradient of a feature to the rank that computed
    it. A rank owning none of the pack's items of a kind runs `dummy_pixels` / `dummy_grid` (one merged token,
    kept out: zero rows) so every rank makes the same vision calls and the same collectives, forward and backward.
    """
    inner, group = model.model, context_group(model)
    encoder = {}
    for kind, pixel_key in VISION_KINDS:
        rows = batch.get(f"cp_{kind}_rows")
        if rows is None:
            continue
        pixels, grid = batch.get(pixel_key), batch.get(f"cp_{kind}_grid_thw")
        owns = pixels is not None
        if not owns:
            pixels, grid = dummy_pixels, dummy_grid
        encode = inner.get_image_features if kind == "image" else inner.get_video_features
        out = encode(pixels.to(inner.visual.dtype), grid, return_dict=True)
        deepstack = getattr(out, "deepstack_features", None) or []
        local = torch.stack([torch.cat(out.pooler_output), *(torch.cat(f) for f in deepstack)], dim=1)
        local = local if owns else local[:0]
        width = int(batch[f"cp_{kind}_width"])
        local = torch.nn.functional.pad(local, (0, 0, 0, 0, 0, width - local.shape[0]))
        features = gather_sequence(local, group).index_select(0, rows.to(local.device, non_blocking=True))
        pooled, *deep = features.unbind(1)
        encoder[kind] = GatheredVision((pooled,), [(d,) for d in deep] if deep else None)
    return encoder


def _keep_local_tokens(module: torch.nn.Module, args: tuple, kwargs: dict, pack_kwarg: str) -> tuple[tuple, dict]:
    """Language-model pre-hook: keep this rank's tokens of the pack's embeddings (and deepstack visual features)."""
    shard = kwargs.get(pack_kwarg)
    if not isinstance(shard, ContextShard):
        return args, kwargs
    kwargs["inputs_embeds"] = kwargs["inputs_embeds"].index_select(1, shard.local_index)
    if kwargs.get("visual_pos_masks") is not None:
        kwargs["visual_pos_masks"] = kwargs["visual_pos_masks"].index_select(1, shard.local_index)
        kwargs["deepstack_visual_embeds"] = [
            features.index_select(0, shard.visual_rows) for features in kwargs["deepstack_visual_embeds"]
        ]
    return args, kwargs


def enable_context_parallel(model: torch.nn.Module, group: dist.ProcessGroup, pack_kwarg: str) -> None:
    """Make a packed-forward model (modeling.packed.enable_packed_forward) take `shard_pack` batches: it keeps
    `group` for the attention's all-gather and gets the language-model pre-hook. Undo with
    `disable_context_parallel`."""
    if getattr(model, "_context_parallel", None) is not None:
        raise ValueError("context parallelism is already enabled on this model.")
    language_model = model.model.language_model

    def hook(module, args, kwargs):
        return _keep_local_tokens(module, args, kwargs, pack_kwarg)

    handle = language_model.register_forward_pre_hook(hook, with_kwargs=True)
    model._context_parallel = (group, handle)


def disable_context_parallel(model: torch.nn.Module) -> None:
    state = getattr(model, "_context_parallel", None)
    if state is None:
        raise ValueError("context parallelism is not enabled on this model.")
    state[1].remove()
    model._context_parallel = None


def context_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    state = getattr(model, "_context_parallel", None)
    return None if state is None else state[0]
