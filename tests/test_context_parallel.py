"""Context parallelism on one process: the zig-zag shard of a pack and the attention of a shard against the
gathered keys, with the all-gather simulated (the two-process exactness tests are in
tests/test_context_parallel_distributed.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.config import load_config
from core.config_tree import ConfigError
from data.processing import IGNORE_INDEX
from modeling import context_parallel, packed
from modeling.context_parallel import layout, shard_pack, zigzag_indices
from modeling.packed import PACK_KWARG
from verification.varlen_reference import varlen_reference

PAD = 0
MERGE = 2


def synthetic_pack(lengths: list[int], image_tokens: int = 0) -> dict:
    """A host pack shaped like Collator.packed's: token ids = 100 + global position (so a token names its place),
    labels = the next token inside each sample, 4 position rows (row r = r·1000 + position in the sample), the first
    `image_tokens` tokens of every sample marked as image tokens."""
    total = sum(lengths)
    input_ids = np.arange(total, dtype=np.int64) + 100
    shift_labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros((4, total), dtype=np.int64)
    token_types = np.zeros(total, dtype=np.int32)
    start = 0
    for length in lengths:
        shift_labels[start : start + length - 1] = input_ids[start + 1 : start + length]
        for row in range(4):
            positions[row, start : start + length] = row * 1000 + np.arange(length)
        token_types[start : start + image_tokens] = 1
        start += length
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return {
        "input_ids": torch.from_numpy(input_ids)[None],
        "position_ids": torch.from_numpy(positions)[:, None],
        "shift_labels": torch.from_numpy(shift_labels)[None],
        "mm_token_type_ids": torch.from_numpy(token_types)[None],
        "cu_seqlens": torch.from_numpy(cu_seqlens),
        "max_seqlen": max(lengths),
        "seq_idx": torch.zeros(1, total, dtype=torch.int32),
        "sample_lengths": list(lengths),
        "num_label_tokens": int((shift_labels != IGNORE_INDEX).sum()),
        "num_text_tokens": int((token_types == 0).sum()),
    }


@pytest.mark.parametrize("context_size", [2, 3])
def test_zigzag_indices_cut_every_document_into_mirrored_chunks(context_size):
    """Each document is padded to a multiple of 2·CP; rank r holds its chunks r and 2CP-1-r; the ranks' indices
    together cover the padded pack exactly once, and every rank holds the same number of tokens."""
    lengths = [5, 8, 3, 12]
    padded, per_rank = zigzag_indices(lengths, context_size)
    chunks = 2 * context_size
    assert all(p % chunks == 0 and 0 <= p - n < chunks for p, n in zip(padded, lengths))
    assert sorted(np.concatenate(per_rank).tolist()) == list(range(sum(padded)))
    assert len({len(index) for index in per_rank}) == 1
    start = 0
    for length in padded:
        m = length // chunks
        for r, index in enumerate(per_rank):
            mine = index[(index >= start) & (index < start + length)] - start
            expected = [*range(r * m, (r + 1) * m), *range((chunks - 1 - r) * m, (chunks - r) * m)]
            assert mine.tolist() == expected
        start += length


def test_shard_carries_positions_labels_and_boundaries_with_the_tokens():
    """For every rank: the local positions and labels are the padded pack's at the rank's tokens; pad tokens carry
    IGNORE_INDEX; each rank's label_rows are its labelled rows, and the label counts of the ranks add up to the
    pack's (which every shard keeps for the FLOP count); the query chunks and key prefixes are the
    zig-zag chunks and their documents' prefixes; whole-pack inputs are padded, not sharded."""
    lengths = [5, 8, 3]
    batch = synthetic_pack(lengths, image_tokens=2)
    shards = [shard_pack(batch, r, 2, PAD, MERGE) for r in range(2)]
    padded = [8, 8, 4]
    assert sum(s["num_label_tokens"] for s in shards) == batch["num_label_tokens"]
    assert all(s["cp_pack_label_tokens"] == batch["num_label_tokens"] for s in shards)
    for r, shard in enumerate(shards):
        local = shard["cp_local_index"].numpy()
        ids = shard["input_ids"][0].numpy()
        assert ids.shape == (sum(padded),)
        real = ids != PAD
        assert real.sum() == sum(lengths) and (ids[real] == np.arange(sum(lengths)) + 100).all()
        # the local labels are the next tokens of the local tokens' samples, IGNORE_INDEX on pads and sample ends
        labels = shard["shift_labels"][0].numpy()
        assert shard["label_rows"].tolist() == np.flatnonzero(labels != IGNORE_INDEX).tolist()
        for token, label in zip(ids[local], labels):
            if token == PAD:
                assert label == IGNORE_INDEX
            elif label != IGNORE_INDEX:
                assert label == token + 1
        positions = shard["position_ids"][:, 0].numpy()
        assert positions.shape == (4, len(local))
        for row in range(4):  # positions restart per sample and run on through the pad of its sample
            start = 0
            for length in padded:
                inside = (local >= start) & (local < start + length)
                assert (positions[row, inside] == row * 1000 + local[inside] - start).all()
                start += length
        q_lengths = [length // 4 for length in padded for _ in range(2)]
        k_lengths = [length // 4 * (c + 1) for length in padded for c in (r, 3 - r)]
        assert shard["cp_q_lengths"] == q_lengths and shard["cp_k_lengths"] == k_lengths
        assert shard["cp_cu_seqlens_k"].tolist() == np.concatenate([[0], np.cumsum(k_lengths)]).tolist()
        assert shard["cp_max_seqlen_k"] == max(k_lengths)
        assert "seq_idx" not in shard and "cu_seqlens" not in shard
        # visual rows: the local image tokens' rank among the pack's image tokens
        types = shard["mm_token_type_ids"][0].numpy()
        visual_order = np.cumsum(types != 0) - 1
        assert shard["cp_visual_rows"].tolist() == visual_order[local][types[local] != 0].tolist()


def test_kv_index_picks_each_chunks_document_prefix_from_the_gathered_keys():
    """Gathering the ranks' local tokens rank-major and taking cp_kv_index gives, for every query chunk, its
    document's tokens from the document start to the chunk's end, in order."""
    batch = synthetic_pack([7, 13, 4])
    shards = [shard_pack(batch, r, 2, PAD, MERGE) for r in range(2)]
    gathered = torch.cat([s["cp_local_index"] for s in shards])
    padded_starts = np.concatenate([[0], np.cumsum([8, 16, 4])[:-1]])
    for shard in shards:
        keys = gathered[shard["cp_kv_index"]].split(shard["cp_k_lengths"])
        for segment, (start, k_length) in zip(keys, zip(np.repeat(padded_starts, 2), shard["cp_k_lengths"])):
            assert segment.tolist() == list(range(start, start + k_length))
        queries = shard["cp_local_index"].split(shard["cp_q_lengths"])
        for query, key in zip(queries, keys):  # every chunk ends where its key prefix ends
            assert query[-1] == key[-1]


def full_attention(query, key, value, lengths, scaling):
    return packed.per_segment_sdpa(query, key, value, lengths, scaling, causal=True)


def shard_attention(query, key, value, shard, scaling):
    """A rank's text attention as the model calls it (the registered attention with the pack's ContextShard):
    q (1,H,T_local,D), k/v (1,Hkv,T_local,D) → (T_local,H,D)."""
    out, _ = packed.packed_attention_forward(None, query, key, value, None, scaling=scaling, **{PACK_KWARG: shard})
    return out[0]


@pytest.mark.parametrize("context_size", [2, 3])
def test_shard_attention_on_the_varlen_path_equals_full_attention_rows(monkeypatch, context_size):
    """The GPU's path of a shard's attention (a half dtype; each query chunk against its document's key prefix, by
    cu_seqlens_q / cu_seqlens_k and max_seqlen_q / max_seqlen_k), with the varlen call replaced by a CPU stand-in
    that honours separate boundaries bottom-right (verification/varlen_reference.py): each rank's bf16 rows equal
    the whole pack's per-sample causal attention at its tokens (fp32) within bf16 rounding."""
    torch.manual_seed(0)
    lengths = [5, 11, 3, 8]
    batch = synthetic_pack(lengths)
    padded, _ = zigzag_indices(lengths, context_size)
    heads, kv_heads, dim, total = 4, 2, 8, sum(padded)
    query = torch.randn(1, heads, total, dim, dtype=torch.bfloat16)
    key, value = (torch.randn(1, kv_heads, total, dim, dtype=torch.bfloat16) for _ in range(2))
    scaling = dim**-0.5
    reference = full_attention(query.float(), key.float(), value.float(), padded, scaling)
    shards = [shard_pack(batch, r, context_size, PAD, MERGE) for r in range(context_size)]
    stacked = torch.stack([key[0].transpose(0, 1), value[0].transpose(0, 1)], dim=1)
    gathered = torch.cat([stacked[s["cp_local_index"]] for s in shards])
    monkeypatch.setattr(context_parallel, "gather_sequence", lambda local, group: gathered)
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(args)
        return varlen_reference(*args, **kwargs)

    monkeypatch.setattr(packed, "VARLEN_DEVICES", ("cpu",))
    monkeypatch.setattr(packed, "varlen_kernel", stand_in)
    for shard in shards:
        index = shard["cp_local_index"]
        cp = context_parallel.context_shard(shard, group=None, device=torch.device("cpu"))
        assert any(q < k for q, k in zip(cp.q_lengths, cp.k_lengths)), "no chunk whose keys reach before it"
        out = shard_attention(query[:, :, index], key[:, :, index], value[:, :, index], cp, scaling)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), reference[index], rtol=2**-8, atol=1e-5)
    assert len(calls) == context_size and all(call[7] is not None for call in calls)  # separate key boundaries


@pytest.mark.gpu
def test_varlen_stand_in_equals_the_varlen_kernel_gpu():
    """The CPU stand-in (verification/varlen_reference.py) computes what the GPU's varlen call computes for query
    segments shorter than their key segments (bottom-right causal) and for equal ones, within bf16 rounding."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    q_lengths, k_lengths = [7, 64, 1, 33], [7, 200, 40, 33]
    query = torch.randn(sum(q_lengths), 8, 64, device=device, dtype=torch.bfloat16)
    key, value = (torch.randn(sum(k_lengths), 2, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
    cu_q, cu_k = (
        torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32, device=device)
        for n in (q_lengths, k_lengths)
    )
    args = (query, key, value, cu_q, max(q_lengths), 64**-0.5, True, cu_k, max(k_lengths))
    kernel, stand_in = packed.varlen_kernel(*args), varlen_reference(*args)
    atol = 2 * ((kernel + 0.3 - 0.3) - kernel).abs().max().item()  # the kernel's own bf16 rounding
    torch.testing.assert_close(stand_in.float(), kernel.float(), rtol=0, atol=atol)


@pytest.mark.parametrize("context_size", [2, 3])
def test_shard_attention_equals_full_attention_rows(monkeypatch, context_size):
    """Each rank's attention of its query chunks against the gathered keys (the all-gather simulated) equals the
    rows of causal per-sample attention over the whole padded pack at its tokens, forward and d/dq, in fp32."""
    torch.manual_seed(0)
    lengths = [5, 11, 3, 8]
    batch = synthetic_pack(lengths)
    padded, _ = zigzag_indices(lengths, context_size)
    heads, kv_heads, dim, total = 4, 2, 8, sum(padded)
    query = torch.randn(1, heads, total, dim, dtype=torch.float64)
    key, value = (torch.randn(1, kv_heads, total, dim, dtype=torch.float64) for _ in range(2))
    scaling = dim**-0.5
    reference = full_attention(query, key, value, padded, scaling)
    grad_out = torch.randn_like(reference)
    query_ref = query.clone().requires_grad_()
    (full_attention(query_ref, key, value, padded, scaling) * grad_out).sum().backward()
    shards = [shard_pack(batch, r, context_size, PAD, MERGE) for r in range(context_size)]
    # the simulated all-gather: every rank's local k|v stacked rank-major
    stacked = torch.stack([key[0].transpose(0, 1), value[0].transpose(0, 1)], dim=1)
    gathered = torch.cat([stacked[s["cp_local_index"]] for s in shards])
    monkeypatch.setattr(context_parallel, "gather_sequence", lambda local, group: gathered)
    for shard in shards:
        index = shard["cp_local_index"]
        cp = context_parallel.context_shard(shard, group=None, device=torch.device("cpu"))
        q_local = query[:, :, index].clone().requires_grad_()
        k_local, v_local = key[:, :, index], value[:, :, index]
        out = shard_attention(q_local, k_local, v_local, cp, scaling)
        torch.testing.assert_close(out, reference[index], rtol=1e-12, atol=1e-12)
        (out * grad_out[index]).sum().backward()
        torch.testing.assert_close(q_local.grad, query_ref.grad[:, :, index], rtol=1e-12, atol=1e-12)


def test_layout_and_config_refusals():
    """Ranks form consecutive context groups; a world the context size does not divide, a context size below 1, and
    context parallelism over padded batches are refused with the fix."""
    assert layout(5, 8, 2) == context_parallel.ContextLayout(data_rank=2, data_size=4, context_rank=1, context_size=2)
    assert layout(3, 4, 1) == context_parallel.ContextLayout(3, 4, 0, 1)
    with pytest.raises(ConfigError, match="does not divide the 3 launched processes"):
        layout(0, 3, 2)
    with pytest.raises(ConfigError, match=r"parallel\.context must be >= 1"):
        load_config("recipes/tiny-qwen2_5_vl.yaml", ["parallel.context=0"])
    with pytest.raises(ConfigError, match=r"packing\.mode=packed"):
        load_config("recipes/tiny-qwen2_5_vl.yaml", ["parallel.context=2", "packing.mode=padded"])
    assert load_config("recipes/tiny-qwen2_5_vl.yaml").parallel.context == 1


@pytest.mark.gpu
@pytest.mark.parametrize("context_size", [2, 4])
def test_shard_attention_equals_full_attention_rows_bf16_gpu(monkeypatch, context_size):
    """On CUDA in bf16 the varlen kernel (flash-attn, else torch's varlen_attn) runs each query chunk against its
    document prefix with causal masking aligned bottom-right: each rank's rows equal the full pack's varlen
    attention at its tokens, within the reference's own bf16 rounding."""
    torch.manual_seed(0)
    lengths = [300, 1100, 37, 800]
    batch = synthetic_pack(lengths)
    padded, _ = zigzag_indices(lengths, context_size)
    heads, kv_heads, dim, total = 16, 2, 128, sum(padded)
    device, dtype = torch.device("cuda"), torch.bfloat16
    query = torch.randn(1, heads, total, dim, device=device, dtype=dtype)
    key, value = (torch.randn(1, kv_heads, total, dim, device=device, dtype=dtype) for _ in range(2))
    scaling = dim**-0.5
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(padded)]), dtype=torch.int32, device=device)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    reference = packed.varlen_kernel(q, k, v, cu_seqlens, max(padded), scaling, True)
    atol = 2 * ((reference + 0.3 - 0.3) - reference).abs().max().item()  # the reference's own bf16 rounding
    shards = [shard_pack(batch, r, context_size, PAD, MERGE) for r in range(context_size)]
    stacked = torch.stack([k, v], dim=1)
    gathered = torch.cat([stacked[s["cp_local_index"].to(device)] for s in shards])
    monkeypatch.setattr(context_parallel, "gather_sequence", lambda local, group: gathered)
    for shard in shards:
        index = shard["cp_local_index"].to(device)
        cp = context_parallel.context_shard(shard, group=None, device=device)
        out = shard_attention(query[:, :, index], key[:, :, index], value[:, :, index], cp, scaling)
        torch.testing.assert_close(out.float(), reference[index].float(), rtol=0, atol=atol)


@pytest.mark.parametrize(
    "patches, context_size, owners",
    [
        ([16, 8, 32], 2, [1, 1, 0]),
        ([1024, 256, 256, 256, 256, 512], 2, [0, 1, 1, 0, 1, 1]),
        ([64, 64, 64, 64], 3, [0, 1, 2, 0]),
        ([5], 4, [0]),
    ],
)
def test_vision_items_are_dealt_largest_first_to_the_least_loaded_rank(patches, context_size, owners):
    """Largest first to the rank with the fewest patches (ties to the lower rank): [1024, 256 x 4, 512] splits
    1280 / 1280 where dealing by count would give 1536 / 1024."""
    assert context_parallel.deal_by_patches(patches, context_size) == owners


def test_vision_shard_deals_images_by_patches_and_gathers_them_back_in_pack_order():
    """Each image goes to the context rank `deal_by_patches` names (the 32-patch image alone on rank 0, the 16- and
    8-patch ones on rank 1) with exactly its patch rows, in pack order; the rows each rank would gather (every
    rank's merged tokens padded to the widest rank, rank-major) put every merged token of the pack back in pack
    order; a rank owning no video gets none (and runs a dummy), while the video's rows still cover it."""
    batch = synthetic_pack([40, 30])
    grids = torch.tensor([[1, 4, 4], [1, 2, 4], [2, 4, 4]])
    patches = grids.prod(-1)
    batch["image_grid_thw"] = grids
    batch["pixel_values"] = torch.arange(int(patches.sum()), dtype=torch.float32)[:, None].repeat(1, 3)
    batch["video_grid_thw"] = torch.tensor([[2, 2, 2]])
    batch["pixel_values_videos"] = torch.zeros(8, 3)
    shards = [shard_pack(batch, r, 2, PAD, MERGE) for r in range(2)]
    starts = torch.cat([torch.zeros(1, dtype=torch.long), patches.cumsum(0)])
    owned = [[2], [0, 1]]
    for r, shard in enumerate(shards):
        expected = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in owned[r]]).float()
        assert torch.equal(shard["pixel_values"][:, 0], expected)
        assert torch.equal(shard["cp_image_grid_thw"], grids[owned[r]])
        assert torch.equal(shard["image_grid_thw"], grids)
    merged = (patches // MERGE**2).tolist()
    first = [sum(merged[:i]) for i in range(3)]
    width = shards[0]["cp_image_width"]
    assert width == max(sum(merged[i] for i in mine) for mine in owned)
    local = [torch.cat([torch.arange(first[i], first[i] + merged[i]) for i in mine]) for mine in owned]
    gathered = torch.cat([torch.nn.functional.pad(t, (0, width - len(t)), value=-1) for t in local])
    for shard in shards:
        assert torch.equal(gathered[shard["cp_image_rows"]], torch.arange(sum(merged)))
    assert shards[0]["pixel_values_videos"] is not None and shards[1]["pixel_values_videos"] is None
    assert shards[1]["cp_video_rows"].tolist() == [0, 1]
    assert context_parallel.has_vision(shards[1], "pixel_values_videos")


@pytest.mark.parametrize("context_size", [2, 3])
def test_gather_order_puts_the_gathered_shards_back_in_padded_pack_order(context_size):
    """Gathering the ranks' local rows rank-major and taking cp_gather_order gives the padded pack, position by
    position; cp_padded_lengths / cp_padded_cu_seqlens are its documents' boundaries, the same on every rank."""
    lengths = [5, 11, 1, 8]
    batch = synthetic_pack(lengths)
    padded, _ = zigzag_indices(lengths, context_size)
    shards = [shard_pack(batch, r, context_size, PAD, MERGE) for r in range(context_size)]
    padded_ids = shards[0]["input_ids"][0]
    gathered_ids = torch.cat([padded_ids[s["cp_local_index"]] for s in shards])
    for shard in shards:
        order = shard["cp_gather_order"]
        assert order.dtype == torch.long and order.shape == (sum(padded),)
        assert torch.equal(gathered_ids[order], padded_ids)
        assert torch.equal(torch.cat([s["cp_local_index"] for s in shards])[order], torch.arange(sum(padded)))
        assert shard["cp_padded_lengths"] == padded
        assert shard["cp_padded_cu_seqlens"].dtype == torch.int32
        assert shard["cp_padded_cu_seqlens"].tolist() == np.concatenate([[0], np.cumsum(padded)]).tolist()


@pytest.mark.parametrize("context_size", [2, 3])
def test_gated_delta_shard_equals_whole_pack_rows(monkeypatch, tiny_model, context_size):
    """A Gated DeltaNet layer given a rank's shard (the all-gather simulated) returns the rows of the same layer run
    on the whole padded pack at the rank's tokens, and the ranks' parameter gradients, each from its own rows,
    sum to the whole pack's (fp32, torch path), within packing_check's fp32 summation-order tolerance: dt_bias's
    and A_log's gradients are near-cancelling sums whose per-rank parts exceed their total (~1e-5 relative here)."""
    from modeling.gated_delta import gated_delta_layers
    from verification.packing_check import GRAD_SCALE_FLOOR, RELATIVE_TOLERANCE

    model = tiny_model("qwen3_5")
    packed.enable_packed_forward(model, "torch")
    layer = gated_delta_layers(model)[0]
    lengths = [37, 1, 9, 20]
    batch = synthetic_pack(lengths)
    padded, _ = zigzag_indices(lengths, context_size)
    torch.manual_seed(0)
    hidden = torch.randn(1, sum(padded), layer.hidden_size)
    whole_pack = packed.PackedSeqlens(
        torch.tensor(np.concatenate([[0], np.cumsum(padded)]), dtype=torch.int32), max(padded), tuple(padded)
    )
    reference = layer(hidden, packed_seqlens=whole_pack)
    grad_out = torch.randn_like(reference)
    (reference * grad_out).sum().backward()
    expected = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    shards = [shard_pack(batch, r, context_size, PAD, MERGE) for r in range(context_size)]
    gathered = torch.cat([hidden[0, s["cp_local_index"]] for s in shards])
    monkeypatch.setattr(context_parallel, "gather_sequence", lambda local, group: gathered)
    for shard in shards:
        index = shard["cp_local_index"]
        cp = context_parallel.context_shard(shard, group=None, device=torch.device("cpu"))
        out = layer(hidden[:, index], packed_seqlens=cp)
        torch.testing.assert_close(out, reference[:, index], rtol=1e-6, atol=1e-6)
        (out * grad_out[:, index]).sum().backward()
    floor = GRAD_SCALE_FLOOR * max(g.abs().max() for g in expected.values())
    for name, parameter in layer.named_parameters():
        scale = expected[name].abs().max().clamp(min=floor)
        assert (parameter.grad - expected[name]).abs().max() / scale < RELATIVE_TOLERANCE[torch.float32], name


def test_gated_delta_shard_takes_fla_with_the_padded_packs_boundaries(monkeypatch, tiny_model):
    """With the fla backend (CUDA, half precision), a shard's Gated DeltaNet call runs fla's varlen forward once, on
    the gathered whole padded pack with the padded samples' cu_seqlens and lengths, and keeps the rank's rows.
    (fla itself is stubbed by the identity: this checks what it is given.)"""
    from modeling import gated_delta

    model = tiny_model("qwen3_5", dtype="bfloat16")
    packed.enable_packed_forward(model, "torch")
    layer = gated_delta.gated_delta_layers(model)[0]
    lengths = [37, 1, 9]
    batch = synthetic_pack(lengths)
    shards = [shard_pack(batch, r, 2, PAD, MERGE) for r in range(2)]
    total = len(shards[0]["cp_gather_order"])
    hidden = torch.arange(total, dtype=torch.bfloat16)[None, :, None].expand(1, total, layer.hidden_size)
    gathered = torch.cat([hidden[0, s["cp_local_index"]] for s in shards])
    monkeypatch.setattr(context_parallel, "gather_sequence", lambda local, group: gathered)
    calls = []

    def fla_stub(module, hidden_states, cu_seqlens, lengths):
        calls.append((hidden_states, cu_seqlens, lengths))
        return hidden_states

    monkeypatch.setattr(gated_delta, "_fla_varlen_forward", fla_stub)
    for shard in shards:
        cp = context_parallel.context_shard(shard, group=None, device=torch.device("cpu"))
        index = shard["cp_local_index"]
        out = gated_delta.packed_gated_delta_forward(
            layer, packed.PACK_KWARG, "fla", hidden[:, index], **{packed.PACK_KWARG: cp}
        )
        whole, cu_seqlens, padded = calls.pop()
        assert torch.equal(whole, hidden) and torch.equal(out, hidden[:, index])
        assert padded == (40, 4, 12) and cu_seqlens.tolist() == [0, 40, 44, 56]


def test_runs_saved_before_parallel_existed_resume_unchanged(tmp_path):
    """A run directory whose config.yaml predates the `parallel` section resumes with parallel.context=1 as no
    change (it is what that run did), while asking it for context parallelism is a change that breaks exactness."""
    import yaml

    from core import config_tree
    from lifecycle import resume

    cfg = load_config("recipes/tiny-qwen2_5_vl.yaml")
    config_tree.save(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del saved["parallel"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert resume.check_config(cfg, tmp_path, resuming=True, allow_changes=False) == {}
    with pytest.raises(ConfigError, match=r"parallel\.context"):
        resume.check_config(
            load_config("recipes/tiny-qwen2_5_vl.yaml", ["parallel.context=2"]), tmp_path, True, allow_changes=False
        )
