"""Packed (THD) forward == per-sample forward, for the six Qwen-VL families (modeling/packed.py, gated_delta.py)."""

import inspect
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface

from core.families import MODEL_TYPES
from data.collate import VIDEO_SECONDS, VISION_INPUTS
from modeling import gated_delta, parts
from modeling.packed import (
    PACKED_ATTENTION,
    disable_packed_forward,
    enable_packed_forward,
    is_packed_forward_enabled,
    packed_attention_forward,
    packed_model_inputs,
    varlen_dtype,
)
from mrope_kernels.patch import patch_model
from tests.tiers import tiered
from verification.packing_check import (
    RELATIVE_TOLERANCE,
    PackingReport,
    SampleSpec,
    compare_packed_to_per_sample,
    label_loss,
    pack_samples,
    samples_from_batch,
)

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = MODEL_TYPES  # every family of the registry, so a new one cannot be missed
GDN_FAMILIES = ("qwen3_5", "qwen3_5_moe")

MIXED_PACK = (
    SampleSpec(0, ((4, 4),), text_after=9),  # the pack starts with an image
    SampleSpec(70),  # text only, longer than the 64-token delta-rule chunk
    SampleSpec(1),  # one token: no label
    SampleSpec(3, ((2, 4), (4, 2)), text_between=3),  # two images, the sample ends with one
    SampleSpec(2, ((4, 4),), text_after=0),  # the pack ends with an image
)
BUDGET_FILLING = (SampleSpec(40, ((4, 8),), text_after=50),)  # one sample filling the whole pack
VIDEO_PACK = (
    SampleSpec(0, videos=((3, 4, 4),), text_after=5),  # the pack starts with a video (odd t: the temporal axis moves)
    SampleSpec(4, ((2, 4),), text_between=3, videos=((2, 2, 4), (1, 4, 2)), text_after=2),  # image + two videos
    SampleSpec(6),  # text only between videos
    SampleSpec(2, videos=((2, 4, 4),)),  # the pack ends with a video
)


VISUAL_FIELDS = ("input_ids", "shift_labels", "mm_token_type_ids", *VISION_INPUTS)

MODERATE_SHAPES = {  # wider heads than the tiny recipes (head_dim 128 / 256 as in the real models), for the GPU
    "qwen2_5_vl": [
        "model.config.text_config.hidden_size=512",
        "model.config.text_config.rope_parameters.mrope_section=[16,24,24]",
        "model.config.vision_config.hidden_size=256",
        "model.config.vision_config.out_hidden_size=512",
    ],
    "qwen3_5": [
        "model.config.text_config.hidden_size=512",
        "model.config.text_config.head_dim=256",
        "model.config.text_config.rope_parameters.mrope_section=[11,11,10]",
        "model.config.text_config.linear_key_head_dim=128",
        "model.config.text_config.linear_value_head_dim=128",
        "model.config.vision_config.hidden_size=256",
        "model.config.vision_config.out_hidden_size=512",
    ],
}


def merge_size(model) -> int:
    return model.config.vision_config.spatial_merge_size


def assert_within(report: PackingReport, rtol: float) -> None:
    assert report.grads, "no gradients compared"
    assert not report.failures(rtol), "\n".join(report.failures(rtol))


def apply_rope(model, rope: str) -> None:
    if rope == "fused":
        patch_model(model)


@pytest.mark.parametrize("rope", ["unfused", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_equals_per_sample(tiny_samples, tiny_model, family, rope):
    """Logits, loss and every parameter gradient of a pack equal the per-sample forward+backward (fp32, summation
    noise only): images at the start and end of the pack, text-only, 1-token and multi-image samples, Gated
    DeltaNet layers across boundaries; unfused and fused rope."""
    model = tiny_model(family)
    apply_rope(model, rope)
    enable_packed_forward(model)
    report = compare_packed_to_per_sample(model, tiny_samples(model, MIXED_PACK))
    assert_within(report, RELATIVE_TOLERANCE[torch.float32])


@pytest.mark.parametrize("family", tiered(FAMILIES, fast=("qwen2_5_vl",)))
def test_packed_equals_per_sample_with_lora(tiny_samples, tiny_model, family):
    """With LoRA adapters on every linear layer of the language model, the ViT blocks and the mergers (lora_B drawn at
    random, so the adapters change the logits), a pack of images, videos and text gives the logits, loss and every
    adapter's gradient of the per-sample forward+backward (fp32, dropout 0): the adapters open no path across
    samples. (The fused rope on an adapted model: tests/test_patch.py.)"""
    from tests.test_lora import adapted, packed_logits

    model = tiny_model(family)
    enable_packed_forward(model)
    samples = tiny_samples(model, (MIXED_PACK[0], MIXED_PACK[3], VIDEO_PACK[1]))
    base_logits = packed_logits(model, pack_samples(model, samples))
    adapted(model, vision=True, merger=True)
    adapted_logits = packed_logits(model, pack_samples(model, samples))
    assert (adapted_logits - base_logits).abs().max() > 1e-2 * base_logits.abs().max()
    report = compare_packed_to_per_sample(model, samples)
    assert_within(report, RELATIVE_TOLERANCE[torch.float32])
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert {d.name for d in report.grads} == trained
    assert any(".visual.blocks." in name for name in trained) and any(".merger" in name for name in trained)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_videos_equal_per_sample(tiny_samples, tiny_model, family):
    """Videos (several temporal patches, so the temporal mRoPE axis advances; Qwen2.5-VL spaced by
    second_per_grid_ts; Qwen3-VL/3.5 one timestamped block per temporal patch) mixed with images and text in one
    pack: logits, loss and every gradient equal the per-sample forward+backward (fp32), fused rope."""
    model = tiny_model(family)
    apply_rope(model, "fused")
    enable_packed_forward(model)
    samples = tiny_samples(model, VIDEO_PACK, seed=2)
    positions = pack_samples(model, samples)["position_ids"]
    video = pack_samples(model, samples)["mm_token_type_ids"][0] == 2
    assert positions[1, 0, video].unique().numel() > 1, "the temporal axis never moved"
    report = compare_packed_to_per_sample(model, samples)
    assert_within(report, RELATIVE_TOLERANCE[torch.float32])


@pytest.mark.parametrize("family", FAMILIES)
def test_budget_filling_sample(tiny_samples, tiny_model, family):
    """A pack holding one sample that fills the whole budget equals that sample's own forward+backward."""
    model = tiny_model(family)
    enable_packed_forward(model)
    report = compare_packed_to_per_sample(model, tiny_samples(model, BUDGET_FILLING, seed=1))
    assert_within(report, RELATIVE_TOLERANCE[torch.float32])


def test_packed_equals_per_sample_with_gradient_checkpointing(tiny_samples, tiny_model):
    """Gradient checkpointing as train.py enables it (decoder layers and ViT blocks, modeling/parts.py) replays the
    layers with the pack's boundaries: packed == per-sample still."""
    model = tiny_model("qwen3_5")
    parts.enable_gradient_checkpointing(model, llm=True, vision=True)
    model.train()
    enable_packed_forward(model)
    report = compare_packed_to_per_sample(model, tiny_samples(model, MIXED_PACK))
    assert_within(report, RELATIVE_TOLERANCE[torch.float32])


def leaking_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Text attention that ignores the pack (one causal window over all samples); vision stays per image."""
    kwargs.pop("packed_seqlens", None)
    if kwargs.get("cu_seq_lens_q") is not None:
        return packed_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2), None


def _compare_with_leaking_attention(model, samples) -> PackingReport:
    enable_packed_forward(model)
    AttentionInterface.register(PACKED_ATTENTION, leaking_attention)
    try:
        return compare_packed_to_per_sample(model, samples)
    finally:
        AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)


def test_comparison_catches_leaking_attention(tiny_samples, tiny_model):
    """Guard: with an attention that ignores the pack (one causal window over all samples) the same comparison
    fails, so the equality tests cannot pass if the packed attention is bypassed."""
    model = tiny_model("qwen2_5_vl")
    report = _compare_with_leaking_attention(model, tiny_samples(model, MIXED_PACK))
    assert report.logits.relative > 1e-2
    assert report.failures(RELATIVE_TOLERANCE[torch.float32])


def test_bf16_comparison_catches_leaking_attention(tiny_samples, tiny_model):
    """Guard for low precision: a leak fails in bf16 although the runs' own rounding errors excuse some difference,
    both in the bf16 logits (never excused by the packed run's rounding) and in the fp32 copy's packed vs per-sample
    comparison (judged at the fp32 tolerance)."""
    model = tiny_model("qwen2_5_vl", dtype="bfloat16")
    report = _compare_with_leaking_attention(model, tiny_samples(model, MIXED_PACK))
    failures = report.failures(RELATIVE_TOLERANCE[torch.bfloat16])
    assert any(f.startswith("logits:") for f in failures), failures
    assert any(f.startswith("fp32 copy, logits:") for f in failures), failures


def test_bf16_cpu_vision_heavy_pack_passes(tiny_samples, tiny_model):
    """bf16 on the CPU with ~1.3k vision patches in the pack (Qwen3-VL, LayerNorm vision tower): packed ==
    per-sample within the runs' own rounding, and the fp32 copy's packed run equals its per-sample run at the fp32
    tolerance. (The CPU LayerNorm backward sums weight/bias gradients over all rows of a call in bf16, so here the
    packed run is much less exact than the per-sample one; verification/packing_check.py.)"""
    model = tiny_model("qwen3_vl", dtype="bfloat16")
    enable_packed_forward(model)
    specs = (SampleSpec(4, ((16, 16), (16, 16)), text_after=4), SampleSpec(3, ((16, 16),)), SampleSpec(5, ((16, 24),)))
    report = compare_packed_to_per_sample(model, tiny_samples(model, specs, seed=2))
    assert report.exact, "no fp32 copy compared"
    assert_within(report, RELATIVE_TOLERANCE[torch.bfloat16])


def test_check_runs_fp32_in_ieee_precision_whatever_the_tf32_settings(tiny_samples, tiny_model):
    """Every forward of the check (the bf16 runs and their fp32 copy) sees IEEE fp32 for matmuls and cuDNN
    convolutions, even where the process allows TF32 (cuDNN convolutions do by default), and the process's settings
    come back afterwards: the fp32 comparisons are judged at the fp32 tolerance."""
    backends = {"matmul": torch.backends.cuda.matmul, "conv": torch.backends.cudnn.conv}
    saved = {name: backend.fp32_precision for name, backend in backends.items()}
    seen = []
    model = tiny_model("qwen2_5_vl", dtype="bfloat16")
    enable_packed_forward(model)
    try:
        for backend in backends.values():
            backend.fp32_precision = "tf32"
        with torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: seen.append(tuple(b.fp32_precision for b in backends.values()))
        ):
            report = compare_packed_to_per_sample(model, tiny_samples(model, MIXED_PACK[:2]))
        assert report.exact, "no fp32 copy compared"
        assert seen and set(seen) == {("ieee", "ieee")}
        assert {name: backend.fp32_precision for name, backend in backends.items()} == dict.fromkeys(backends, "tf32")
    finally:
        for name, backend in backends.items():
            backend.fp32_precision = saved[name]


def _gdn_layer_and_pack(tiny_model, family: str):
    model = tiny_model(family)
    layer = gated_delta.gated_delta_layers(model)[0]
    lengths = (5, 70, 1, 33)
    hidden = torch.randn(
        1, sum(lengths), model.config.text_config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    per_sample = torch.cat([layer(h[None]) for h in hidden[0].split(list(lengths))], dim=1)
    return model, layer, lengths, hidden, per_sample


@pytest.mark.parametrize("family", GDN_FAMILIES)
def test_gated_delta_torch_path_equals_per_sample(tiny_model, family):
    """The boundary-aware Gated DeltaNet forward on a flat pack equals the layer run on each sample alone: the causal
    conv and the recurrent state restart at every boundary (samples longer than one 64-token chunk included)."""
    model, layer, lengths, hidden, per_sample = _gdn_layer_and_pack(tiny_model, family)
    enable_packed_forward(model)
    inputs = packed_model_inputs(
        model,
        {
            "input_ids": torch.zeros(1, sum(lengths), dtype=torch.long),
            "position_ids": torch.zeros(4, 1, sum(lengths), dtype=torch.long),
            "cu_seqlens": torch.tensor([0, 5, 75, 76, 109], dtype=torch.int32),
            "max_seqlen": 70,
            "sample_lengths": list(lengths),
        },
    )
    packed = layer(hidden, packed_seqlens=inputs["packed_seqlens"])
    torch.testing.assert_close(packed, per_sample, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", GDN_FAMILIES)
def test_unpatched_gated_delta_leaks(tiny_model, family):
    """Guard: transformers' own Gated DeltaNet torch path run on the same flat pack mixes the samples (its conv and
    state run across boundaries), so the test above can fail if our path is bypassed."""
    _, layer, _, hidden, per_sample = _gdn_layer_and_pack(tiny_model, family)
    leaked = layer(hidden)
    assert (leaked - per_sample).abs().max() > 1e-3


def test_gated_delta_backend_fails_before_training_when_unavailable(tiny_model, monkeypatch):
    """Asking for fla's Gated DeltaNet kernels where they cannot train fails at enable time, naming the reason,
    and leaves the model untouched; "auto" falls back to the exact torch path."""
    monkeypatch.setattr(gated_delta, "fla_blocker", lambda: "flash-linear-attention is not installed")
    model = tiny_model("qwen3_5")
    with pytest.raises(ValueError, match="flash-linear-attention is not installed"):
        enable_packed_forward(model, gated_delta_backend="fla")
    assert not is_packed_forward_enabled(model)
    assert all("forward" not in vars(layer) for layer in gated_delta.gated_delta_layers(model))
    assert enable_packed_forward(model, gated_delta_backend="auto") == "torch"


def test_torch_backend_forces_and_restores_the_torch_delta_rule(tiny_model):
    """The torch backend makes the modeling module call transformers' own torch delta rule (never a kernel whose
    backward may refuse) while enabled, and disable_packed_forward puts the original function back."""
    model = tiny_model("qwen3_5")
    modeling = sys.modules[type(gated_delta.gated_delta_layers(model)[0]).__module__]
    original = modeling.torch_chunk_gated_delta_rule
    enable_packed_forward(model, gated_delta_backend="torch")
    assert modeling.torch_chunk_gated_delta_rule is inspect.unwrap(original)
    disable_packed_forward(model)
    assert modeling.torch_chunk_gated_delta_rule is original


def test_fla_chunk_table_is_built_on_the_host_per_sample():
    """fla's varlen chunk table, built from the pack's Python lengths (no device sync): one (sample, chunk) row per
    64-token chunk of every sample, a sample's last chunk partial (lengths 1, 63, 64, 65 and 130 give 1, 1, 1, 2
    and 3 chunks), the dtype of our cu_seqlens, and one table per pack however many layers ask."""
    lengths = (1, 63, 64, 65, 130)
    table = gated_delta.fla_chunk_indices(lengths, torch.device("cpu"))
    expected = [[0, 0], [1, 0], [2, 0], [3, 0], [3, 1], [4, 0], [4, 1], [4, 2]]
    assert table.dtype == torch.int32 and table.tolist() == expected
    assert gated_delta.fla_chunk_indices(lengths, torch.device("cpu")) is table
    assert gated_delta.fla_chunk_indices((64,), torch.device("cpu")).tolist() == [[0, 0]]


@pytest.mark.gpu
def test_fla_chunk_table_equals_the_one_fla_derives():
    """On CUDA with fla installed (requirements-fla.txt): the host-built table equals fla's own, derived from the
    device cu_seqlens, for a pack with lengths around the chunk size."""
    index = pytest.importorskip("fla.ops.utils.index", reason="flash-linear-attention is not installed")
    lengths = (1, 63, 64, 65, 500, 129, 7)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    ours = gated_delta.fla_chunk_indices(lengths, cu_seqlens.device)
    assert torch.equal(ours, index.prepare_chunk_indices(cu_seqlens, gated_delta.FLA_CHUNK))


def test_padded_batch_through_enabled_model(tiny_samples, tiny_model):
    """The same enabled model serves the padded baseline: a right-padded batch (attention_mask, no pack) gives each
    sample's own logits on its real tokens."""
    model = tiny_model("qwen3_5")
    enable_packed_forward(model)
    samples = tiny_samples(model, (SampleSpec(9), SampleSpec(3, ((4, 4),), text_after=4)))
    alone = [model(input_ids=s.input_ids[None], mm_token_type_ids=s.mm_token_type_ids[None],
                   pixel_values=s.pixel_values, image_grid_thw=s.image_grid_thw, use_cache=False).logits[0]
             for s in samples]  # fmt: skip
    width = max(len(s) for s in samples)
    input_ids = torch.zeros(len(samples), width, dtype=torch.long)
    types = torch.zeros(len(samples), width, dtype=torch.int32)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, : len(sample)] = sample.input_ids
        types[row, : len(sample)] = sample.mm_token_type_ids
        mask[row, : len(sample)] = 1
    padded = model(
        input_ids=input_ids,
        attention_mask=mask,
        mm_token_type_ids=types,
        pixel_values=samples[1].pixel_values,
        image_grid_thw=samples[1].image_grid_thw,
        use_cache=False,
    ).logits
    for row, logits in enumerate(alone):
        torch.testing.assert_close(padded[row, : logits.shape[0]], logits, rtol=1e-4, atol=1e-5)


def test_packed_inputs_refuse_unprepared_model_and_bad_boundaries(tiny_samples, tiny_model):
    """Packed inputs are refused for a model without the packed forward (its samples would leak silently) and for
    boundaries that disagree with the tokens; disable_packed_forward restores the original model."""
    model = tiny_model("qwen3_5")
    batch = pack_samples(model, tiny_samples(model, (SampleSpec(4), SampleSpec(6))))
    with pytest.raises(ValueError, match="enable_packed_forward"):
        packed_model_inputs(model, batch)
    enable_packed_forward(model)
    with pytest.raises(ValueError, match="sum to T"):
        packed_model_inputs(model, {**batch, "sample_lengths": [4, 5]})
    disable_packed_forward(model)
    assert not is_packed_forward_enabled(model)
    assert model.config.text_config._attn_implementation == "sdpa"
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert all("forward" not in vars(layer) for layer in gated_delta.gated_delta_layers(model))


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_equals_per_sample_bf16_gpu(tiny_samples, tiny_model, family):
    """On CUDA in bf16 (varlen_attn / flash-attn for text and vision), packed == per-sample within bf16 rounding,
    on a moderate pack (several hundred tokens, several images)."""
    model = tiny_model(family, dtype="bfloat16").cuda()
    enable_packed_forward(model)
    specs = (*MIXED_PACK, SampleSpec(200, ((8, 8), (4, 12)), text_between=30, text_after=60), SampleSpec(150))
    report = compare_packed_to_per_sample(model, tiny_samples(model, specs, device="cuda"))
    assert_within(report, RELATIVE_TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_videos_equal_per_sample_bf16_gpu(tiny_samples, tiny_model, family):
    """On CUDA in bf16, a pack of videos (several temporal patches, timestamps for Qwen3-VL/3.5), images and text
    equals the per-sample runs within bf16 rounding."""
    model = tiny_model(family, dtype="bfloat16").cuda()
    enable_packed_forward(model)
    specs = (*VIDEO_PACK, SampleSpec(100, ((8, 8),), text_between=20, videos=((4, 8, 8),), text_after=40))
    report = compare_packed_to_per_sample(model, tiny_samples(model, specs, device="cuda"))
    assert_within(report, RELATIVE_TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(MODERATE_SHAPES))
def test_packed_equals_per_sample_bf16_gpu_moderate_heads(tiny_samples, tiny_model, family):
    """The bf16 GPU equality at real head sizes (text head_dim 128 / 256, vision head_dim 128), where the varlen
    kernels take their production code paths."""
    model = tiny_model(family, dtype="bfloat16", overrides=MODERATE_SHAPES[family]).cuda()
    enable_packed_forward(model)
    specs = (*MIXED_PACK, SampleSpec(300, ((8, 8), (4, 12)), text_between=30, text_after=60), SampleSpec(250))
    report = compare_packed_to_per_sample(model, tiny_samples(model, specs, device="cuda"))
    assert_within(report, RELATIVE_TOLERANCE[torch.bfloat16])


class _LeakGradientAcrossSamples(torch.autograd.Function):
    """Identity forward; the backward adds a tenth of the gradient 8 tokens later, which crosses sample boundaries."""

    @staticmethod
    def forward(ctx, out):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad + 0.1 * grad.roll(-8, dims=0)


def _varlen_with_backward_leak(query, key, value, cu_seqlens, max_seqlen, scaling, causal, engine="fa2"):
    """A stand-in varlen kernel (q (T,H,D)): exact forward (per-segment SDPA), a backward that leaks across samples."""
    import modeling.packed as packed

    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    out = packed.per_segment_sdpa(*(t.transpose(0, 1)[None] for t in (query, key, value)), lengths, scaling, causal)
    return _LeakGradientAcrossSamples.apply(out)


def test_bf16_check_catches_a_leak_only_in_the_varlen_backward(tiny_samples, tiny_model, monkeypatch):
    """Where the low-precision pack takes the varlen kernel and its fp32 copy cannot, a leak in that kernel's
    backward alone (forward exact, so logits agree) must fail on the gradients: the packed run's error against its
    fp32 copy contains the leak and must not excuse it. Simulated on the CPU by routing bf16 through a leaky
    stand-in kernel."""
    import modeling.packed as packed

    monkeypatch.setattr(packed, "VARLEN_DEVICES", ("cpu",))
    monkeypatch.setattr("verification.packing_check.VARLEN_DEVICES", ("cpu",))
    monkeypatch.setattr(packed, "varlen_kernel", _varlen_with_backward_leak)
    model = tiny_model("qwen2_5_vl", dtype="bfloat16")
    enable_packed_forward(model)
    report = compare_packed_to_per_sample(model, tiny_samples(model, MIXED_PACK))
    failures = report.failures(RELATIVE_TOLERANCE[torch.bfloat16])
    assert not report.logits.failed(RELATIVE_TOLERANCE[torch.bfloat16])
    assert any(not line.startswith(("logits", "loss", "fp32 copy")) for line in failures), failures


def test_varlen_dtype_follows_autocast():
    """The varlen kernel's dtype is autocast's when autocast is on (fp32 q/k from a q/k RMSNorm beside a bf16 v must
    not fall back to per-sample SDPA), and otherwise only a half dtype shared by q, k and v."""
    q32, v16 = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16)
    assert varlen_dtype(q32, q32, v16) is None
    assert varlen_dtype(q32, q32, q32) is None
    assert varlen_dtype(v16, v16, v16) is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert varlen_dtype(q32, q32, v16) is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert varlen_dtype(q32, q32, q32) is torch.float16


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_fp32_master_weights_under_autocast_take_varlen_gpu(tiny_samples, tiny_model, family, monkeypatch):
    """As train.py runs it (fp32 weights, bf16 autocast), every packed attention call of a model with fp32 q/k
    norms goes to the one varlen kernel per layer, never to the per-sample SDPA fallback, and gives the logits of
    the per-segment SDPA path under the same autocast (within bf16 rounding)."""
    import modeling.packed as packed

    calls = {"varlen": 0, "per_segment": 0}
    varlen, per_segment = packed.varlen_kernel, packed.per_segment_sdpa

    def count(name, function):
        def counted(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return counted

    monkeypatch.setattr(packed, "varlen_kernel", count("varlen", varlen))
    monkeypatch.setattr(packed, "per_segment_sdpa", count("per_segment", per_segment))
    model = tiny_model(family).cuda()
    enable_packed_forward(model)
    batch = pack_samples(model, tiny_samples(model, MIXED_PACK, device="cuda"))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(**packed_model_inputs(model, batch), use_cache=False).logits
    attention_layers = sum(hasattr(layer, "self_attn") for layer in model.model.language_model.layers)
    assert calls == {"varlen": attention_layers + model.config.vision_config.depth, "per_segment": 0}
    monkeypatch.setattr(packed, "VARLEN_DEVICES", ())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        per_segment_logits = model(**packed_model_inputs(model, batch), use_cache=False).logits
    assert calls["per_segment"] > 0
    difference = (logits.float() - per_segment_logits.float()).abs().max() / per_segment_logits.float().abs().max()
    assert difference <= RELATIVE_TOLERANCE[torch.bfloat16]


def test_samples_from_batch_inverts_pack_samples(tiny_samples, tiny_model):
    """Splitting a packed batch gives back each sample: tokens, labels, token types, its own images, videos and
    pixels."""
    model = tiny_model("qwen3_vl")
    samples = tiny_samples(model, MIXED_PACK + VIDEO_PACK)
    for original, split in zip(
        samples, samples_from_batch(pack_samples(model, samples), merge_size(model)), strict=True
    ):
        for name in (*VISUAL_FIELDS, VIDEO_SECONDS):
            expected, got = getattr(original, name), getattr(split, name)
            assert (expected is None and got is None) or torch.equal(expected, got), name


def verify_packing_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m scripts.verify_packing ARGS` from the repository root, its output captured as text."""
    command = [sys.executable, "-m", "scripts.verify_packing", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)


def test_verify_packing_script_passes_on_a_tiny_recipe(tmp_path):
    """`python -m scripts.verify_packing` on a tiny recipe's own data pipeline (its collator's positions and
    boundaries) exits 0 and prints one row per pack."""
    overrides = [f"data.cache_dir={tmp_path}", "data.num_samples=40", "packing.max_tokens=256"]
    done = verify_packing_cli("--config", "recipes/tiny-qwen3_5.yaml", "--packs", "2", "--rope", "unfused", *overrides)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("\nunfused ") == 2 and "PASS" in done.stdout


@pytest.mark.slow
def test_verify_packing_script_checks_a_lora_recipes_adapters(tmp_path):
    """On a LoRA recipe, scripts/verify_packing.py applies the recipe's adapters (B drawn at random) and compares their
    gradients, the only trained ones, packed vs per sample: it passes and names an adapter as the worst gradient."""
    overrides = [f"data.cache_dir={tmp_path}", "data.num_samples=40", "packing.max_tokens=256"]
    done = verify_packing_cli("--config", "recipes/lora-tiny.yaml", "--packs", "1", "--rope", "unfused", *overrides)
    assert done.returncode == 0, done.stdout + done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("unfused "))
    assert ".lora_" in row and "PASS" in done.stdout


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl_moe", "qwen3_5"])
@pytest.mark.slow
def test_verify_packing_script_passes_with_videos(tmp_path, family):
    """scripts/verify_packing.py on a tiny recipe with a video-heavy built-in dataset (frame-list videos through
    the real pipeline: Qwen2.5-VL's second_per_grid_ts, Qwen3 timestamps, MoE routing, Gated DeltaNet) passes in
    fp32, fused rope, and its pack holds videos (test_packed_videos_equal_per_sample covers all six families)."""
    overrides = [f"data.cache_dir={tmp_path}", "data.num_samples=12", "data.video_share=0.7", "packing.max_tokens=384"]
    done = verify_packing_cli(
        "--config", f"recipes/tiny-{family}.yaml", "--packs", "1", "--rope", "fused", "--device", "cpu", *overrides
    )
    assert done.returncode == 0, done.stdout + done.stderr
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("fused "))
    assert int(row[3]) > 0, done.stdout  # videos in the pack


LEAKING_CLI = """
import runpy, sys
import modeling.packed as packed
from tests.test_packed_forward import leaking_attention
packed.packed_attention_forward = leaking_attention  # what enable_packed_forward registers
sys.argv[0] = "verify_packing"
runpy.run_module("scripts.verify_packing", run_name="__main__")
"""


def test_verify_packing_script_fails_on_a_leaking_attention(tmp_path):
    """The same command line exits 1 and names the failing quantities when the packed attention leaks across samples
    (the leak put in its place before the script runs)."""
    overrides = [f"data.cache_dir={tmp_path}", "data.num_samples=40", "packing.max_tokens=256"]
    args = ["--config", "recipes/tiny-qwen2_5_vl.yaml", "--packs", "1", "--rope", "unfused", *overrides]
    done = subprocess.run(
        [sys.executable, "-c", LEAKING_CLI, *args], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL" in done.stdout and "FAIL unfused pack 0: logits" in done.stderr


def test_label_loss_normalises_by_total_labels():
    """label_loss is the summed token cross entropy divided by the given label count (ignored tokens excluded)."""
    logits = torch.randn(1, 4, 7)
    labels = torch.tensor([[1, -100, 3, -100]])
    expected = torch.nn.functional.cross_entropy(logits[0, [0, 2]], labels[0, [0, 2]], reduction="sum") / 5
    torch.testing.assert_close(label_loss(logits, labels, 5), expected)
