"""The packed attention's engines (modeling/attention_engines.py, `kernels.attention`): how a run picks one, which
calls each takes, and — on a GPU with flash-attn-4 — that fa4 computes what fa2 computes."""

from __future__ import annotations

import types

import pytest
import torch

from core.config import load_config
from modeling import attention_engines, parts
from modeling.build import build_model
from modeling.packed import PACKED_ATTENTION, attention_name, enable_packed_forward, packed_model_inputs
from tests.test_packed_forward import MIXED_PACK
from trainer import defaults
from verification.packing_check import pack_samples

HAS_FA4 = attention_engines.HAS_FLASH_ATTN_4


def test_auto_without_cuda_resolves_to_fa2_and_says_why():
    """On a host without CUDA, auto is fa2 with the reason; fa2 asked for is fa2."""
    engine, why = attention_engines.resolve_engine("auto", torch.device("cpu"))
    assert engine == "fa2" and "fa4 not used" in why
    assert attention_engines.resolve_engine("fa2", torch.device("cpu"))[0] == "fa2"


def test_fa4_where_it_cannot_run_is_an_error_naming_the_cause():
    """kernels.attention=fa4 on a host without it stops with one line saying what is missing, never a silent fa2."""
    with pytest.raises(ValueError, match=r"kernels.attention=fa4 cannot run here: .*(not installed|no CUDA)"):
        attention_engines.resolve_engine("fa4", torch.device("cpu"))
    with pytest.raises(ValueError, match="must be auto, fa2 or fa4"):
        attention_engines.resolve_engine("fa3", torch.device("cpu"))


@pytest.mark.parametrize("head_dim", [64, 72, 80, 96, 128, 256])
def test_fa4_takes_only_the_head_dims_it_computes_exactly(head_dim):
    """fa4 runs a call only at the head dims measured exact (64, 128, 256); 72 and 80, whose fa4 backward was wrong,
    and dims never measured stay on fa2; fa2 always stays fa2."""
    expected = "fa4" if head_dim in (64, 128, 256) else "fa2"
    assert attention_engines.engine_for_head_dim("fa4", head_dim) == expected
    assert attention_engines.engine_for_head_dim("fa2", head_dim) == "fa2"


def test_describe_names_each_part_engine():
    text = attention_engines.describe("fa4", {"text": 128, "vision": 80})
    assert text == "text (head dim 128): fa4; vision (head dim 80): fa2"


@pytest.mark.parametrize(
    ("recipe", "dims"),
    [
        ("recipes/qwen2_5_vl-3b.yaml", {"text": 128, "vision": 80}),
        ("recipes/qwen3_vl-2b.yaml", {"text": 128, "vision": 64}),
        ("recipes/qwen3_5-2b.yaml", {"text": 256, "vision": 64}),
        ("recipes/qwen3_vl-8b.yaml", {"text": 128, "vision": 72}),
    ],
)
def test_attention_head_dims_of_the_recipes(recipe, dims):
    """The head dims the engine choice reads, from each recipe's published architecture (built on the meta device)."""
    cfg = load_config(recipe)
    with torch.device("meta"):
        model = build_model(cfg.model, seed=0)
    assert parts.attention_head_dims(model) == dims


def test_qwen2_vl_vision_head_dim_reads_embed_dim():
    """Qwen2-VL's vision config calls the ViT's width embed_dim (its hidden_size is the LLM's)."""
    config = types.SimpleNamespace(
        text_config=types.SimpleNamespace(hidden_size=64, num_attention_heads=4),
        vision_config=types.SimpleNamespace(embed_dim=96, hidden_size=64, num_heads=3),
    )
    assert parts.attention_head_dims(types.SimpleNamespace(config=config)) == {"text": 16, "vision": 32}


def test_each_engine_registers_its_own_attention_name(tiny_model, tiny_samples):
    """enable_packed_forward sets the engine's registry name on every config, and the name holds "flash" (one
    varlen call per ViT layer); on the CPU both engines take per-sample SDPA and give the same logits."""
    logits = {}
    for engine in ("fa2", "fa4"):
        model = tiny_model("qwen2_5_vl")
        enable_packed_forward(model, attention_engine=engine)
        names = {sub.config._attn_implementation for sub in model.modules() if hasattr(sub, "config")}
        assert names == {attention_name(engine)} and "flash" in attention_name(engine)
        batch = pack_samples(model, tiny_samples(model, MIXED_PACK))
        with torch.no_grad():
            logits[engine] = model(**packed_model_inputs(model, batch), use_cache=False).logits
    assert attention_name("fa2") == PACKED_ATTENTION
    torch.testing.assert_close(logits["fa4"], logits["fa2"], rtol=0, atol=0)


def test_resolve_writes_the_engine_into_the_config(cpu_accelerator):
    """kernels.attention=auto is made concrete before the run's config.yaml is written (fa2 without CUDA)."""
    cfg = defaults.resolve(load_config("recipes/tiny-qwen2_5_vl.yaml"), cpu_accelerator)
    assert cfg.kernels.attention == "fa2"


@pytest.fixture
def cpu_accelerator():
    return types.SimpleNamespace(
        device=torch.device("cpu"), distributed_type="NO", num_processes=1, process_index=0, is_main_process=True
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_FA4, reason="needs a CUDA device and flash-attn-4")
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "causal"), [(4, 2, 128, True), (4, 4, 64, False)])
def test_fa4_equals_fa2_on_a_pack_gpu(heads, kv_heads, head_dim, causal):
    """fa4's output and gradients are as close to an fp32 per-document reference as fa2's are (within 2×), on a pack
    of odd document lengths."""
    from verification.lever_bench import reference, relative_error

    lengths = (37, 300, 1, 129, 514)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    scale = head_dim**-0.5
    ref = reference(q, k, v, dout, lengths, scale, causal)
    errors = {}
    for engine in ("fa2", "fa4"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention_engines.varlen_attention(engine, *leaves, cu, cu, max(lengths), max(lengths), scale, causal)
        out.backward(dout)
        errors[engine] = [relative_error(x, r) for x, r in zip([out, *(t.grad for t in leaves)], ref)]
    for fa4, fa2 in zip(errors["fa4"], errors["fa2"]):
        assert fa4 <= 2 * fa2 + 1e-4, errors


def test_bench_packs_fill_the_pack_with_documents_in_range():
    """The attention bench's packs hold exactly the pack's tokens, every document but the cut last one in range,
    and each ViT case has the text's images as patches."""
    from verification.lever_bench import recipe_cases, sample_lengths

    lengths = sample_lengths(16384, 370, 1140, seed=3)
    assert sum(lengths) == 16384 and all(370 <= n <= 1140 for n in lengths[:-1])
    cases = {case.name: case for case in recipe_cases(4096, seed=1)}
    text = cases["qwen3_vl-2b text 16/8×128"].lengths
    assert sum(text) == 4096
    assert cases["qwen3_vl-2b ViT 16×64"].lengths == tuple(4 * max(n - 112, 16) for n in text)
    assert set(cases["qwen2_5_vl ViT windows 16×80"].lengths) == {64}


def test_bench_commands_refuse_a_host_without_cuda():
    """Without a GPU both bench commands stop with one line saying why (their kernels are GPU kernels)."""
    from verification.lever_bench import attention_main, fp8_main

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    for main in (attention_main, fp8_main):
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            main([])


def test_the_model_sends_each_head_dim_to_its_engine(tiny_model, tiny_samples, monkeypatch):
    """With fa4 chosen, every packed varlen call of a model goes to fa4 only where its head dim is one fa4 computes
    exactly, and to fa2 elsewhere: the text and the ViT of one model can take different engines. Simulated on the
    CPU: the varlen path taken in bf16, each call recorded and computed per segment."""
    import modeling.packed as packed

    calls = []

    def recording(engine, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal):
        calls.append((engine, q.shape[-1], causal))
        lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        return packed.per_segment_sdpa(*(t.transpose(0, 1)[None] for t in (q, k, v)), lengths, scale, causal)

    monkeypatch.setattr(packed, "VARLEN_DEVICES", ("cpu",))
    monkeypatch.setattr(attention_engines, "varlen_attention", recording)
    monkeypatch.setattr(attention_engines, "FA4_HEAD_DIMS", (16,))
    model = tiny_model("qwen3_vl", dtype="bfloat16", vision_config={"num_heads": 1})  # text head dim 16, ViT 32
    enable_packed_forward(model, attention_engine="fa4")
    batch = pack_samples(model, tiny_samples(model, MIXED_PACK))
    with torch.no_grad():
        model(**packed_model_inputs(model, batch), use_cache=False)
    text_layers, vision_blocks = len(model.model.language_model.layers), model.config.vision_config.depth
    assert sorted(set(calls)) == [("fa2", 32, False), ("fa4", 16, True)]
    assert calls.count(("fa4", 16, True)) == text_layers and calls.count(("fa2", 32, False)) == vision_blocks
