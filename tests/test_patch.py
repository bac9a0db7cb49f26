"""mrope_kernels.patch_model / unpatch_model on tiny random models of the six Qwen-VL families (CPU) and on one
full-size layer per family (GPU): exact, provably in effect, reversible, and refusing what it cannot reproduce.

The six-family equality tests run the kernels' plain-PyTorch reference (fast); `test_kernel_path_*` and the
compile test run the public ops as shipped (the Triton kernels, under TRITON_INTERPRET=1 on CPU).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import importlib
import logging

import pytest
import torch
import transformers
from transformers.vision_utils import get_vision_position_ids

from core import families
from core.special_tokens import IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID
from mrope_kernels import PatchError, apply_rope_choice, ops, patch_model, reference, unpatch_model
from mrope_kernels import patch as patch_module
from tests.tiers import tiered

FAMILIES = list(families.FAMILIES)
# One chunked and one interleaved, partial-rotary family run in the fast tier; the others in `make test-all`
FAST_FAMILIES = ("qwen2_5_vl", "qwen3_5")
# An 8×12-patch image: 24 LLM tokens after the 2×2 merge, and several Qwen2.5-VL attention windows.
IMAGE_GRID = (1, 8, 12)


@dataclasses.dataclass
class Outputs:
    logits: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def image_batch(model, grid=IMAGE_GRID, text_len: int = 8, device="cpu") -> dict:
    """Two equal-length samples (no padding), each with one image at a different offset, as the model's own
    `get_rope_index` positions them."""
    vision = model.config.vision_config
    t, h, w = grid
    image_tokens = t * h * w // vision.spatial_merge_size**2
    gen = torch.Generator().manual_seed(0)

    def text(n):
        return torch.randint(10, model.config.text_config.vocab_size, (n,), generator=gen)

    image = torch.cat(
        [torch.tensor([VISION_START_ID]), torch.full((image_tokens,), IMAGE_TOKEN_ID), torch.tensor([VISION_END_ID])]
    )
    half = text_len // 2
    input_ids = torch.stack([torch.cat([image, text(text_len)]), torch.cat([text(half), image, text(text_len - half)])])
    mm_token_type_ids = (input_ids == IMAGE_TOKEN_ID).int()
    patch_dim = 3 * vision.temporal_patch_size * vision.patch_size**2
    pixel_values = torch.randn(2 * t * h * w, patch_dim, generator=gen)
    image_grid_thw = torch.tensor([grid, grid])
    position_ids, _ = model.model.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw)
    batch = dict(
        input_ids=input_ids,
        mm_token_type_ids=mm_token_type_ids,
        pixel_values=pixel_values,
        image_grid_thw=image_grid_thw,
        position_ids=position_ids,
        labels=input_ids,
    )
    return {k: v.to(device) for k, v in batch.items()}


def forward_backward(model, batch: dict) -> Outputs:
    """Logits, loss and every parameter's gradient of one training step."""
    model.zero_grad(set_to_none=True)
    dtype = next(model.parameters()).dtype
    out = model(**dict(batch, pixel_values=batch["pixel_values"].to(dtype)), use_cache=False)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return Outputs(out.logits.detach().clone(), out.loss.detach().clone(), grads)


def assert_outputs_close(actual: Outputs, expected: Outputs, rtol: float, atol: float) -> None:
    assert actual.grads.keys() == expected.grads.keys()
    torch.testing.assert_close(actual.logits, expected.logits, rtol=rtol, atol=atol)
    torch.testing.assert_close(actual.loss, expected.loss, rtol=rtol, atol=atol)
    for name in expected.grads:
        torch.testing.assert_close(actual.grads[name], expected.grads[name], rtol=rtol, atol=atol, msg=name)


def assert_outputs_equal(actual: Outputs, expected: Outputs) -> None:
    assert actual.grads.keys() == expected.grads.keys()
    assert torch.equal(actual.logits, expected.logits) and torch.equal(actual.loss, expected.loss)
    assert all(torch.equal(actual.grads[n], expected.grads[n]) for n in expected.grads)


def max_diff(a: Outputs, b: Outputs) -> dict[str, float]:
    grad = max((a.grads[n].float() - b.grads[n].float()).abs().max().item() for n in a.grads)
    return {
        "logits": (a.logits.float() - b.logits.float()).abs().max().item(),
        "loss": (a.loss.float() - b.loss.float()).abs().item(),
        "grad": grad,
    }


def assert_bf16_within_rounding(patched: Outputs, unpatched: Outputs, truth: Outputs) -> None:
    """Patched and unpatched bf16 runs are two bf16 roundings of the same fp32 function: logits and each gradient
    differ by at most 3x the unpatched run's own error against the fp32 model plus one bf16 ulp at the tensor's
    largest magnitude; the fp32 loss (mean cross entropy, 2-Lipschitz in the logits) by at most twice the logits'
    difference."""
    ulp = torch.finfo(torch.bfloat16).eps

    def check(name, p, u, f):
        bound = 3 * (u.float() - f).abs().max() + ulp * f.abs().max()
        assert (p.float() - u.float()).abs().max() <= bound, name

    check("logits", patched.logits, unpatched.logits, truth.logits)
    for name in truth.grads:
        check(name, patched.grads[name], unpatched.grads[name], truth.grads[name])
    logits_diff = (patched.logits.float() - unpatched.logits.float()).abs().max()
    assert (patched.loss - unpatched.loss).abs() <= 2 * logits_diff + 1e-6


class CallCounter:
    """Counts calls of a wrapped function (spies on transformers' rotary path and on our kernels)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.fixture(autouse=True)
def every_patch_is_undone():
    """Each test unpatches what it patched; a test that leaves transformers' functions replaced fails, and they are
    restored so the next test starts clean. Models patched and dropped elsewhere (other test files) give their
    hold back when collected."""
    gc.collect()
    yield
    gc.collect()
    leaked = sorted(patch_module._GLOBAL_PATCHES)
    for name in leaked:
        modeling = importlib.import_module(name)
        for function, original in patch_module._GLOBAL_PATCHES.pop(name).originals.items():
            setattr(modeling, function, original)
    assert not leaked, f"left patched: {leaked}"


@pytest.fixture
def reference_ops(monkeypatch):
    """Run the patch on the kernels' PyTorch reference, counting calls: {"mrope": counter, "vision": counter}."""
    counters = {
        "mrope": CallCounter(reference.apply_mrope_reference),
        "vision": CallCounter(reference.rotate_by_vision_table_reference),
    }
    monkeypatch.setattr(ops, "apply_mrope", counters["mrope"])
    monkeypatch.setattr(ops, "apply_vision_rope_table", counters["vision"])
    return counters


def spy_on_transformers_rotary(monkeypatch, family: str) -> dict[str, CallCounter]:
    """Counters on the family's apply functions and on its rotary modules' cos/sin path (forward and
    recomposition_frequencies of the text and vision rotary classes)."""
    spec = families.FAMILIES[family]
    modeling = importlib.import_module(spec.modeling_module)
    spies = {}
    for name in (patch_module.TEXT_APPLY, patch_module.VISION_APPLY):
        spies[name] = CallCounter(getattr(modeling, name))
        monkeypatch.setattr(modeling, name, spies[name])
    for cls_name in (spec.text_rotary, spec.vision_rotary):
        cls = getattr(modeling, cls_name)
        for method in ("forward", "recomposition_frequencies"):
            counter = CallCounter(getattr(cls, method))
            spies[f"{cls_name}.{method}"] = counter
            monkeypatch.setattr(cls, method, lambda self, *a, _c=counter, **kw: _c(self, *a, **kw))
    return spies


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_equals_unpatched_fp32_and_transformers_rotary_unused(tiny_model, family, reference_ops, monkeypatch):
    """fp32: logits, loss and every gradient match the unpatched model; while patched, none of transformers'
    rotary functions or cos/sin builders runs and our kernels do; unpatching restores outputs bit for bit."""
    spies = spy_on_transformers_rotary(monkeypatch, family)
    model = tiny_model(family)
    batch = image_batch(model)

    unpatched = forward_backward(model, batch)
    assert all(spy.calls > 0 for spy in spies.values()), {k: s.calls for k, s in spies.items()}

    report = patch_model(model)
    for spy in spies.values():
        spy.calls = 0
    patched = forward_backward(model, batch)
    assert {k: s.calls for k, s in spies.items()} == dict.fromkeys(spies, 0)
    assert reference_ops["mrope"].calls > 0 and reference_ops["vision"].calls > 0
    assert_outputs_close(patched, unpatched, rtol=1e-5, atol=1e-6)
    print(f"{family} fp32 max |patched - unpatched|: {max_diff(patched, unpatched)}")

    unpatch_model(model)
    modeling = importlib.import_module(families.FAMILIES[family].modeling_module)
    assert modeling.apply_rotary_pos_emb is spies[patch_module.TEXT_APPLY]
    assert modeling.apply_rotary_pos_emb_vision is spies[patch_module.VISION_APPLY]
    assert_outputs_equal(forward_backward(model, batch), unpatched)
    assert report.family == family


@pytest.mark.parametrize("family", tiered(FAMILIES, fast=("qwen3_5",)))
def test_patched_lora_model_equals_unpatched(tiny_model, family, reference_ops):
    """As training builds it (rope patch, then LoRA adapters on the language model and the ViT blocks, lora_B drawn at
    random), the patched model's logits, loss and every adapter gradient equal the same adapted model on
    transformers' rotary math (fp32): the adapters wrap linear layers only, and the patch's ops still run."""
    from tests.test_lora import adapted

    reference, patched_model = tiny_model(family), tiny_model(family)
    patch_model(patched_model)
    for model in (reference, patched_model):
        torch.manual_seed(0)  # the same lora_A initialisation on both
        adapted(model, vision=True)
    batch = image_batch(reference)
    unpatched = forward_backward(reference, batch)
    patched = forward_backward(patched_model, batch)
    unpatch_model(patched_model)
    assert reference_ops["mrope"].calls > 0 and reference_ops["vision"].calls > 0
    assert patched.grads and all("lora_" in name for name in patched.grads)
    assert_outputs_close(patched, unpatched, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", tiered(FAMILIES, fast=FAST_FAMILIES))
def test_patched_bf16_within_rounding(tiny_model, family, reference_ops):
    """bf16: patched logits, loss and gradients stay within bf16 rounding of the unpatched bf16 model, measured
    against the same weights in fp32."""
    model32 = tiny_model(family)
    batch = image_batch(model32)
    truth = forward_backward(model32, batch)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    unpatched = forward_backward(model16, batch)
    patch_model(model16)
    patched = forward_backward(model16, batch)
    unpatch_model(model16)
    assert_bf16_within_rounding(patched, unpatched, truth)
    print(
        f"{family} bf16 max |patched - unpatched|: {max_diff(patched, unpatched)}; "
        f"|unpatched - fp32|: {max_diff(unpatched, truth)}"
    )


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("use_reentrant", tiered([False, True], fast=[False]))
@pytest.mark.parametrize("family", tiered(FAMILIES, fast=FAST_FAMILIES))
def test_gradient_checkpointing(tiny_model, family, use_reentrant, reference_ops):
    """With gradient checkpointing (text and vision layers), the patched model matches the unpatched one without
    checkpointing, and the recomputed layers run through our kernels again."""
    model = tiny_model(family)
    batch = image_batch(model)
    expected = forward_backward(model, batch)

    patch_model(model)
    forward_backward(model, batch)
    calls_without_checkpointing = reference_ops["mrope"].calls + reference_ops["vision"].calls
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    checkpointed = forward_backward(model, batch)
    calls_with_checkpointing = reference_ops["mrope"].calls + reference_ops["vision"].calls
    unpatch_model(model)
    assert calls_with_checkpointing - calls_without_checkpointing > calls_without_checkpointing
    assert_outputs_close(checkpointed, expected, rtol=1e-5, atol=1e-6)


def check_compiled_matches_eager(tiny_model, device: str) -> None:
    """torch.compile (aot_eager, fullgraph: any graph break raises) of a patched Qwen3-VL text model and vision
    block reproduces the unpatched eager outputs."""
    model = tiny_model("qwen3_vl").to(device)
    batch = image_batch(model, device=device)
    text_model, vision = model.model.language_model, model.model.visual
    embeds = text_model.embed_tokens(batch["input_ids"]).detach()
    hidden = torch.randn(IMAGE_GRID[1] * IMAGE_GRID[2], vision.config.hidden_size, device=device)
    positions = get_vision_position_ids(batch["image_grid_thw"][:1], vision.spatial_merge_size)
    cu_seqlens = torch.tensor([0, hidden.shape[0]], dtype=torch.int32, device=device)
    block_kwargs = dict(cu_seqlens=cu_seqlens, max_seqlen=hidden.shape[0])
    with torch.no_grad():
        text_expected = text_model(inputs_embeds=embeds, position_ids=batch["position_ids"], use_cache=False)
        block_expected = vision.blocks[0](
            hidden, position_embeddings=vision.rotary_pos_emb(hidden, positions), **block_kwargs
        )

        patch_model(model)
        torch._dynamo.reset()
        compiled_text = torch.compile(text_model, backend="aot_eager", fullgraph=True)
        text_out = compiled_text(inputs_embeds=embeds, position_ids=batch["position_ids"], use_cache=False)
        compiled_block = torch.compile(vision.blocks[0], backend="aot_eager", fullgraph=True)
        block_out = compiled_block(hidden, position_embeddings=vision.rotary_pos_emb(hidden, positions), **block_kwargs)
        unpatch_model(model)
    torch.testing.assert_close(text_out.last_hidden_state, text_expected.last_hidden_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block_out, block_expected, rtol=1e-5, atol=1e-5)


def test_compile_fullgraph_cpu(tiny_model, reference_ops):
    """The patch's carriers, rotary forwards and dispatchers trace into one graph (reference ops on CPU: the
    Triton interpreter does not run inside torch.compile) and reproduce the eager unpatched outputs."""
    check_compiled_matches_eager(tiny_model, "cpu")


@pytest.mark.gpu
def test_compile_fullgraph_gpu(tiny_model):
    """On the GPU, the patched model with the Triton custom ops compiles without a graph break and reproduces the
    eager unpatched outputs."""
    check_compiled_matches_eager(tiny_model, "cuda")


@pytest.mark.parametrize("family", tiered(["qwen2_5_vl", "qwen3_vl", "qwen3_5"], fast=["qwen3_5"]))
def test_kernel_path_fp32_and_bf16(tiny_model, family):
    """With the public ops as shipped (chunked + windowed vision, interleaved, partial rotary), the patched model's
    logits, loss and gradients match the unpatched model in fp32, and stay within bf16 rounding in bf16."""
    model = tiny_model(family)
    batch = image_batch(model)
    expected = forward_backward(model, batch)
    patch_model(model)
    patched = forward_backward(model, batch)
    unpatch_model(model)
    assert_outputs_close(patched, expected, rtol=1e-5, atol=1e-5)

    model16 = model.to(torch.bfloat16)
    unpatched16 = forward_backward(model16, batch)
    patch_model(model16)
    patched16 = forward_backward(model16, batch)
    unpatch_model(model16)
    assert_bf16_within_rounding(patched16, unpatched16, expected)
    print(
        f"{family} kernel path max |patched - unpatched|: fp32 {max_diff(patched, expected)}, "
        f"bf16 {max_diff(patched16, unpatched16)}"
    )


def test_text_dispatcher_rotates_transformers_layout_in_one_autograd_node():
    """transformers' (B, H, S, D) q and k go to the kernel as they are: the outputs keep their layout and hang off the
    rope's own node, which leads straight to q's and k's leaves (no transpose before or after: each costs µs in the
    forward and is one more node in the backward)."""
    apply = patch_module._make_text_apply(None)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel's device (CPU: under the interpreter)
    q = torch.randn(2, 7, 4, 64, device=device).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 7, 2, 64, device=device).transpose(1, 2).requires_grad_()
    positions = torch.randint(0, 100, (3, 2, 7), device=device)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 64, 2, device=device).float() / 64))
    out_q, out_k = apply(q, k, positions, patch_module.MRopeArgs(inv_freq, (8, 12, 12), True, 1.0))
    assert out_q.stride() == q.stride() and out_k.stride() == k.stride()
    node = out_q.grad_fn
    assert node is out_k.grad_fn and type(node).__name__ == "_RopeFunctionBackward"
    (q_leaf, _), (k_leaf, _) = node.next_functions[:2]
    assert q_leaf.variable is q and k_leaf.variable is k


def test_text_dispatcher_rotates_partial_rotary_in_place_on_the_projections_base():
    """Partial rotary (Qwen3.5) in a training forward: transformers' (B, H, S, D) transposes of autograd-tracked
    (B, S, H, D) tensors rotate in place on those bases, returned in the callers' layout, with the out-of-place
    call's values and gradients; leaves (a caller's own tensors) and grad-free calls rotate out of place and leave
    the inputs as they were."""
    torch.manual_seed(12)
    apply = patch_module._make_text_apply(None)
    positions = torch.randint(0, 100, (3, 2, 7))
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, 16, 2).float() / 16))
    rope_args = patch_module.MRopeArgs(inv_freq, (3, 3, 2), True, 1.0)
    q_leaf = torch.randn(2, 7, 4, 48, requires_grad=True)
    k_leaf = torch.randn(2, 7, 2, 48, requires_grad=True)
    grads = (torch.randn(2, 4, 7, 48), torch.randn(2, 2, 7, 48))
    q_in, k_in = q_leaf.detach().transpose(1, 2).requires_grad_(), k_leaf.detach().transpose(1, 2).requires_grad_()
    before = (q_in.detach().clone(), k_in.detach().clone())
    want = apply(q_in, k_in, positions, rope_args)
    assert torch.equal(q_in, before[0]) and torch.equal(k_in, before[1]), "a caller's leaves were modified"
    with torch.no_grad():
        apply(q_in, k_in, positions, rope_args)
    assert torch.equal(q_in, before[0]) and torch.equal(k_in, before[1]), "a grad-free call modified its inputs"
    want_grads = torch.autograd.grad(want, (q_in, k_in), grads)
    q_base, k_base = q_leaf * 1, k_leaf * 1
    got = apply(q_base.transpose(1, 2), k_base.transpose(1, 2), positions, rope_args)
    assert got[0].data_ptr() == q_base.data_ptr() and got[0].stride() == q_in.stride()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got_grads = torch.autograd.grad(got, (q_leaf, k_leaf), grads)
    assert torch.equal(got_grads[0], want_grads[0].transpose(1, 2)) and torch.equal(
        got_grads[1], want_grads[1].transpose(1, 2)
    )


@pytest.mark.parametrize("family", tiered(FAMILIES, fast=FAST_FAMILIES))
def test_vl_model_and_text_model_patch_alone(tiny_model, family, reference_ops):
    """patch_model works on the VL Model (text + vision) and on the text-only model (text rotary and function
    only), each matching its unpatched outputs."""
    model = tiny_model(family)
    batch = image_batch(model)
    expected = forward_backward(model, batch)

    report = patch_model(model.model)
    assert {m.method for m in report.modules} >= {"forward"}
    assert_outputs_close(forward_backward(model, batch), expected, rtol=1e-5, atol=1e-6)
    unpatch_model(model.model)

    text_model = model.model.language_model
    embeds = text_model.embed_tokens(batch["input_ids"]).detach()
    with torch.no_grad():
        text_expected = text_model(inputs_embeds=embeds, position_ids=batch["position_ids"], use_cache=False)
        report = patch_model(text_model)
        text_patched = text_model(inputs_embeds=embeds, position_ids=batch["position_ids"], use_cache=False)
        unpatch_model(text_model)
    assert [m.path for m in report.modules] == ["rotary_emb"]
    assert report.functions == (f"{families.FAMILIES[family].modeling_module}.apply_rotary_pos_emb",)
    torch.testing.assert_close(text_patched.last_hidden_state, text_expected.last_hidden_state, rtol=1e-5, atol=1e-6)


def test_report_names_what_was_replaced(tiny_model):
    """The report lists each replaced module with its flavour (layout, sections, R of D), the window reorder of
    Qwen2.5-VL, the replaced functions and the attention classes that reach them."""
    model = tiny_model("qwen2_5_vl")
    report = patch_model(model)
    unpatch_model(model)
    by_path = {m.path: m for m in report.modules}
    assert by_path["model.language_model.rotary_emb"].flavour == "text mRoPE chunked [2, 3, 3], R=16 of D=16"
    assert by_path["model.visual.rotary_pos_emb"].flavour == "vision 2-D rope, D=16"
    assert by_path["model.visual"].method == "permute_input_for_window_attn"
    assert report.attention_classes == ("Qwen2_5_VLAttention", "Qwen2_5_VLVisionAttention")
    assert len(report.functions) == 2 and "apply_rotary_pos_emb_vision" in str(report)

    model = tiny_model("qwen3_5")
    report = patch_model(model)
    unpatch_model(model)
    flavours = {m.flavour for m in report.modules}
    assert "text mRoPE interleaved [2, 1, 1], R=8 of D=32" in flavours


def test_two_models_of_one_family_with_different_configs(tiny_model, reference_ops):
    """Two patched models of one family with different rotary configs, and an unpatched third, each give their own
    unpatched outputs; transformers' functions come back only when the last patched model is unpatched."""
    modeling = importlib.import_module(families.FAMILIES["qwen3_vl"].modeling_module)
    original_apply = modeling.apply_rotary_pos_emb
    models = [
        tiny_model("qwen3_vl"),
        tiny_model(
            "qwen3_vl",
            text_config={"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}},
        ),
        tiny_model("qwen3_vl"),
    ]
    batches = [image_batch(m) for m in models]
    expected = [forward_backward(m, b) for m, b in zip(models, batches)]
    patch_model(models[0])
    patch_model(models[1])
    for model, batch, exp in zip(models, batches, expected):
        assert_outputs_close(forward_backward(model, batch), exp, rtol=1e-5, atol=1e-6)
    unpatch_model(models[0])
    assert modeling.apply_rotary_pos_emb is not original_apply
    assert_outputs_close(forward_backward(models[1], batches[1]), expected[1], rtol=1e-5, atol=1e-6)
    unpatch_model(models[1])
    assert modeling.apply_rotary_pos_emb is original_apply


def test_deep_copy_of_patched_model_is_patched_and_independent(tiny_model, reference_ops):
    """A deep copy of a patched model runs patched and stays correct after the original is unpatched; the family's
    functions are restored once both are unpatched."""
    model = tiny_model("qwen2_5_vl")
    batch = image_batch(model)
    expected = forward_backward(model, batch)
    patch_model(model)
    clone = copy.deepcopy(model)
    unpatch_model(model)
    calls_before = reference_ops["mrope"].calls
    assert_outputs_close(forward_backward(clone, batch), expected, rtol=1e-5, atol=1e-6)
    assert reference_ops["mrope"].calls > calls_before
    unpatch_model(clone)
    assert_outputs_equal(forward_backward(clone, batch), expected)


def test_rope_args_survive_mixed_precision_input_casting(tiny_model, reference_ops):
    """FSDP2's mixed precision casts each wrapped block's floating-point inputs (through tuples and dataclasses)
    to bf16; the rotary frequencies and the vision cos/sin table travelling in position_embeddings stay fp32 and
    exact."""
    from torch.distributed.utils import _apply_to_tensors

    model = tiny_model("qwen3_vl")
    patch_model(model)
    rotary = model.model.language_model.rotary_emb
    positions = torch.arange(6).view(1, 1, 6).expand(3, 1, 6)
    embeddings = rotary(torch.zeros(1, 6, 4), positions)
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, embeddings)
    assert cast[1].inv_freq.dtype == torch.float32
    assert torch.equal(cast[1].inv_freq, rotary.inv_freq)
    vision_positions = torch.randint(0, 30, (7, 2))
    vision_embeddings = model.model.visual.rotary_pos_emb(torch.zeros(7, 4), vision_positions)
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, vision_embeddings)
    assert cast[1].table.dtype == torch.float32
    assert torch.equal(
        cast[1].table, ops.vision_rope_table(vision_positions, model.model.visual.rotary_pos_emb.inv_freq)
    )
    unpatch_model(model)


def test_dropped_patched_models_give_the_functions_back(tiny_model):
    """A patched model (and its deep copy) garbage-collected without unpatch_model no longer holds transformers'
    apply functions: once the last one is gone the originals are back."""
    modeling = importlib.import_module(families.FAMILIES["qwen3_vl"].modeling_module)
    original = modeling.apply_rotary_pos_emb
    model = tiny_model("qwen3_vl")
    patch_model(model)
    clone = copy.deepcopy(model)
    assert modeling.apply_rotary_pos_emb is not original
    del model
    gc.collect()
    assert modeling.apply_rotary_pos_emb is not original  # the copy still holds them
    del clone
    gc.collect()
    assert modeling.apply_rotary_pos_emb is original


def test_patch_twice_and_unpatch_unpatched_raise(tiny_model):
    """Patching a patched model (or a submodule of it) and unpatching an unpatched one raise PatchError."""
    model = tiny_model("qwen2_vl")
    with pytest.raises(PatchError, match="not patched"):
        unpatch_model(model)
    patch_model(model)
    with pytest.raises(PatchError, match="already patched"):
        patch_model(model)
    with pytest.raises(PatchError, match="already has an instance-level forward"):
        patch_model(model.model.language_model)
    with pytest.raises(PatchError, match="its submodule '0' is"):
        unpatch_model(torch.nn.ModuleList([model]))
    unpatch_model(model)


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize(
    "make_model, reason",
    [
        (lambda tiny_model: _llama(), "no rotary module the fused rope patch knows"),
        (lambda tiny_model: torch.nn.Linear(2, 2), "no rotary module"),
        (
            lambda tiny_model: tiny_model(
                "qwen3_vl", text_config={"rope_parameters": {"rope_type": "linear", "factor": 2.0}}
            ),
            "'linear'",
        ),
        (
            lambda tiny_model: tiny_model(
                "qwen2_5_vl",
                text_config={
                    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
                },
            ),
            "'yarn'",
        ),
        (
            lambda tiny_model: tiny_model(
                "qwen3_5", text_config={"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}
            ),
            "'dynamic'",
        ),
    ],
)
def test_unsupported_models_raise_and_change_nothing(tiny_model, make_model, reason):
    """Models or rotary configs the kernels cannot reproduce exactly raise PatchError with the reason, and the
    model is left untouched."""
    model = make_model(tiny_model)
    modules_before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    with pytest.raises(PatchError, match=reason):
        patch_model(model)
    assert {name: dict(m.__dict__) for name, m in model.named_modules()} == modules_before
    assert not patch_module._GLOBAL_PATCHES  # no family function was replaced


def test_untested_transformers_version_and_attention_scaling_raise(tiny_model, monkeypatch):
    """An untested transformers version, or a rotary module with attention_scaling != 1, raises PatchError."""
    model = tiny_model("qwen3_vl")
    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    with pytest.raises(PatchError, match="untested"):
        patch_model(model)
    monkeypatch.undo()
    model.model.visual.rotary_pos_emb.attention_scaling = 2.0
    with pytest.raises(PatchError, match=r"attention_scaling 2\.0"):
        patch_model(model)


def test_apply_rope_choice(tiny_model, caplog):
    """'unfused' leaves the model alone, 'fused' patches or raises, 'auto' patches or logs why it fell back."""
    model = tiny_model("qwen3_5")
    assert apply_rope_choice(model, "unfused") is None
    assert "forward" not in model.model.language_model.rotary_emb.__dict__
    assert apply_rope_choice(model, "fused").family == "qwen3_5"
    unpatch_model(model)
    assert apply_rope_choice(model, "auto").family == "qwen3_5"
    unpatch_model(model)
    with pytest.raises(PatchError):
        apply_rope_choice(_llama(), "fused")
    with caplog.at_level(logging.WARNING, logger="mrope_kernels.patch"):
        assert apply_rope_choice(_llama(), "auto") is None
    assert "no rotary module the fused rope patch knows" in caplog.text
    with pytest.raises(ValueError, match="'fused', 'unfused' or 'auto'"):
        apply_rope_choice(model, "fast")


_QWEN25_VISION = dict(
    depth=1,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=3584,
    patch_size=14,
    window_size=112,
)
_QWEN3_VISION = dict(
    depth=1, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, num_position_embeddings=2304
)
# One full-size text layer and ViT block per family: the released checkpoints' attention dims, rotary sections
# and θ. Qwen2(.5)-VL-7B: 28/4 heads × 128, chunked [16, 24, 24]; Qwen3-VL-8B: 32/8 × 128, interleaved
# [24, 20, 20]; Qwen3-VL-30B-A3B: 32/4 × 128; Qwen3.5: 24/4 (MoE 16/2) × 256, partial rotary 0.25 → R = 64,
# interleaved [11, 11, 10]. ViT: 16 heads × 80 (Qwen2/2.5, windowed) or × 72. MoE layers get 4 experts, all
# active: experts do not touch rotary, and with no routing choice bf16 noise cannot flip a token's experts.
FULL_SIZE_LAYERS = {
    "qwen2_vl": (
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]),
        ),
        dict(depth=1, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4, patch_size=14),
    ),
    "qwen2_5_vl": (
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]),
        ),
        _QWEN25_VISION,
    ),
    "qwen3_vl": (
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20]),
        ),
        dict(_QWEN3_VISION, out_hidden_size=4096),
    ),
    "qwen3_vl_moe": (
        dict(
            hidden_size=2048,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            moe_intermediate_size=768,
            num_experts=4,
            num_experts_per_tok=4,
            rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20]),
        ),
        dict(_QWEN3_VISION, out_hidden_size=2048),
    ),
    "qwen3_5": (
        dict(
            hidden_size=5120,
            intermediate_size=17408,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            layer_types=["full_attention"],
            rope_parameters=dict(
                rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10]
            ),
        ),
        dict(_QWEN3_VISION, out_hidden_size=5120),
    ),
    "qwen3_5_moe": (
        dict(
            hidden_size=2048,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_experts=4,
            num_experts_per_tok=4,
            layer_types=["full_attention"],
            rope_parameters=dict(
                rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10]
            ),
        ),
        dict(_QWEN3_VISION, out_hidden_size=2048),
    ),
}


def full_size_layer_outputs(
    tiny_model, family: str, device: str, grid, text_len: int
) -> tuple[Outputs, Outputs, Outputs]:
    """(patched bf16, unpatched bf16, fp32 truth) for one full-size text layer + ViT block of the family."""
    text, vision = FULL_SIZE_LAYERS[family]
    model32 = tiny_model(family, text_config=dict(text, num_hidden_layers=1), vision_config=vision).to(device)
    batch = image_batch(model32, grid=grid, text_len=text_len, device=device)
    truth = forward_backward(model32, batch)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    del model32
    unpatched = forward_backward(model16, batch)
    patch_model(model16)
    patched = forward_backward(model16, batch)
    unpatch_model(model16)
    return patched, unpatched, truth


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_full_size_layer_bf16_gpu(tiny_model, family):
    """At full-size head dims, sections and θ (one text layer, one ViT block, two samples of 256 image + 512 text
    tokens), the patched bf16 model's logits, loss and gradients are within bf16 rounding of the unpatched one."""
    patched, unpatched, truth = full_size_layer_outputs(tiny_model, family, "cuda", grid=(1, 32, 32), text_len=512)
    assert_bf16_within_rounding(patched, unpatched, truth)
    print(
        f"{family} full-size bf16 max |patched - unpatched|: {max_diff(patched, unpatched)}; "
        f"|unpatched - fp32|: {max_diff(unpatched, truth)}"
    )
