"""fla's Gated DeltaNet kernels train only where they are exact: the self-check, its cache and the backend choice.

fla is not installed on the CPU; its kernel is replaced by stand-ins (an exact one and wrong ones) and the Hopper
refusal flag by a fake module, so every branch of `resolve_backend` runs here.
"""

from __future__ import annotations

import json
import logging
import sys
import types

import pytest
import torch

from core.config import load_config
from modeling import gated_delta, gated_delta_check
from modeling.build import build_model
from modeling.gated_delta_check import GatedDeltaDims, check_delta_rule, torch_delta_rule_per_sample
from modeling.packed import enable_packed_forward

DIMS = GatedDeltaDims(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)


def leaky_rule(q, k, v, g, beta, cu_seqlens):
    """A kernel that ignores the pack's boundaries: the state of one sample flows into the next."""
    whole = torch.tensor([0, q.shape[1]], dtype=cu_seqlens.dtype)
    return torch_delta_rule_per_sample(q, k, v, g, beta, whole)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def wrong_dg_rule(q, k, v, g, beta, cu_seqlens):
    """Exact forward, wrong gradient of the decay only: the shape of the Hopper bug (a backward-only miscompile)."""
    return torch_delta_rule_per_sample(q, k, v, _ScaleGrad.apply(g, 1.5), beta, cu_seqlens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_kernel_passes(dtype):
    """The torch rule itself in the training dtype passes, with tolerances no tighter than its own error."""
    result = check_delta_rule(torch_delta_rule_per_sample, DIMS, dtype, "cpu")
    assert result.passed, result.worst()
    assert all(result.errors[q] == result.torch_errors[q] for q in gated_delta_check.QUANTITIES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wrong_kernels_fail(dtype):
    """A boundary leak fails on the output; a backward-only error fails on its gradient while o still passes."""
    leak = check_delta_rule(leaky_rule, DIMS, dtype, "cpu")
    assert not leak.passed and leak.errors["o"] > leak.tolerances["o"]
    bad_dg = check_delta_rule(wrong_dg_rule, DIMS, dtype, "cpu")
    assert not bad_dg.passed
    assert bad_dg.errors["dg"] > 10 * bad_dg.tolerances["dg"]
    assert bad_dg.errors["o"] <= bad_dg.tolerances["o"]
    assert bad_dg.worst().startswith("dg ")


def test_check_lengths_cover_chunk_boundaries():
    """The check's pack holds a 1-token sample and samples on both sides of the 64-token chunk size."""
    assert {1, 63, 64, 65} <= set(gated_delta_check.CHECK_LENGTHS)


@pytest.fixture
def guarded_gpu(monkeypatch, tmp_path):
    """A machine where fla is installed and would refuse its backward: the refusal flag lives in a fake module,
    the check runs on the CPU and its cache under tmp_path. Returns a dict counting the stand-in kernel's calls."""
    chunk_o = types.ModuleType("fla.ops.common.chunk_o")
    chunk_o.TRITON_ABOVE_3_7_1 = False
    fla = types.ModuleType("fla")
    fla.ops = types.ModuleType("fla.ops")
    fla.ops.common = types.ModuleType("fla.ops.common")
    fla.ops.common.chunk_o = chunk_o
    for name, module in [("fla", fla), ("fla.ops", fla.ops), ("fla.ops.common", fla.ops.common)]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", chunk_o)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(gated_delta, "fla_blocker", lambda: None)
    monkeypatch.setattr(gated_delta, "fla_refuses_backward", lambda: True)
    monkeypatch.setattr(gated_delta, "_check_device", lambda: torch.device("cpu"))
    calls = {"n": 0, "flag": chunk_o}

    def use(rule):
        def counted(*args):
            calls["n"] += 1
            return rule(*args)

        monkeypatch.setattr(gated_delta, "fla_delta_rule", counted)

    calls["use"] = use
    return calls


def test_wrong_kernel_falls_back_to_torch_and_keeps_the_refusal(guarded_gpu):
    """auto + a kernel that fails the check → the torch path, the reason says so, fla's refusal stays in place;
    an explicit "fla" request raises instead of training with it."""
    guarded_gpu["use"](wrong_dg_rule)
    choice = gated_delta.resolve_backend("auto", {DIMS}, torch.bfloat16)
    assert choice.backend == "torch"
    assert "failed its numeric self-check" in choice.reason and "dg" in choice.reason
    assert guarded_gpu["flag"].TRITON_ABOVE_3_7_1 is False
    with pytest.raises(ValueError, match="self-check"):
        gated_delta.resolve_backend("fla", {DIMS}, torch.bfloat16)


def test_passing_kernel_takes_fla_and_the_verdict_is_cached(guarded_gpu, tmp_path):
    """A kernel that passes → fla with the refusal lifted; the second resolution reads the cached verdict from disk
    without running the kernel; another dtype or head layout is checked on its own."""
    guarded_gpu["use"](torch_delta_rule_per_sample)
    choice = gated_delta.resolve_backend("auto", {DIMS}, torch.bfloat16)
    assert choice.backend == "fla" and "checked now" in choice.reason
    assert guarded_gpu["flag"].TRITON_ABOVE_3_7_1 is True
    calls = guarded_gpu["n"]
    assert calls > 0 and (tmp_path / "qwen-vl-packed-train" / "gated_delta_check.json").is_file()

    again = gated_delta.resolve_backend("auto", {DIMS}, torch.bfloat16)
    assert again.backend == "fla" and "cached" in again.reason and guarded_gpu["n"] == calls
    gated_delta.resolve_backend("auto", {DIMS}, torch.float16)
    assert guarded_gpu["n"] > calls


def test_cached_failure_is_not_rerun(guarded_gpu):
    """A failed verdict is remembered as well: no second run of a kernel known to be wrong on this machine."""
    guarded_gpu["use"](leaky_rule)
    assert gated_delta.resolve_backend("auto", {DIMS}, torch.bfloat16).backend == "torch"
    calls = guarded_gpu["n"]
    assert gated_delta.resolve_backend("auto", {DIMS}, torch.bfloat16).backend == "torch"
    assert guarded_gpu["n"] == calls


def test_model_falls_back_and_logs_why(guarded_gpu, caplog):
    """A Qwen3.5 model on a machine where fla fails its check trains on the torch path (checked with the model's own
    Gated DeltaNet dims), and one log line names the backend and the reason."""
    seen = []

    def recording(q, k, v, g, beta, cu_seqlens):
        seen.append((k.shape[2], v.shape[2], k.shape[3], v.shape[3]))
        return leaky_rule(q, k, v, g, beta, cu_seqlens)

    guarded_gpu["use"](recording)
    model = build_model(load_config("recipes/tiny-qwen3_5.yaml").model, attn_implementation="sdpa")
    layer = gated_delta.gated_delta_layers(model)[0]
    with caplog.at_level(logging.INFO, logger="modeling.gated_delta"):
        assert enable_packed_forward(model, "auto", compute_dtype=torch.bfloat16) == "torch"
    assert seen and seen[0] == (layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    lines = [r.getMessage() for r in caplog.records if "Gated DeltaNet:" in r.getMessage()]
    assert len(lines) == 1 and "torch backend" in lines[0] and "self-check" in lines[0]


def test_model_on_fla_logs_the_backend_and_its_first_run_cost(guarded_gpu, caplog):
    """Where fla passes its check, the log names the fla backend and says that its kernels compile on first use
    (minutes on an empty Triton cache), so a first step that takes minutes does not look like a hang."""
    guarded_gpu["use"](torch_delta_rule_per_sample)
    model = build_model(load_config("recipes/tiny-qwen3_5.yaml").model, attn_implementation="sdpa")
    with caplog.at_level(logging.INFO, logger="modeling.gated_delta"):
        assert enable_packed_forward(model, "auto", compute_dtype=torch.bfloat16) == "fla"
    lines = [r.getMessage() for r in caplog.records if "Gated DeltaNet:" in r.getMessage()]
    assert len(lines) == 2 and "fla backend" in lines[0] and lines[1] == gated_delta.FLA_FIRST_RUN_NOTE


@pytest.mark.parametrize("damage", ["torn", "not an object", "not UTF-8", "an entry of another shape"])
def test_unreadable_cache_is_ignored(guarded_gpu, tmp_path, damage):
    """A torn or corrupt cache file, or an entry of another shape, costs one re-check, never a crash; the re-check
    is remembered in its place."""
    path = tmp_path / "qwen-vl-packed-train" / "gated_delta_check.json"
    path.parent.mkdir(parents=True)
    key = gated_delta_check.environment_key(DIMS, torch.bfloat16, torch.device("cpu"))
    contents = {
        "torn": b"{not json",
        "not an object": b"[1, 2]",
        "not UTF-8": b"\xff\xfe{",
        "an entry of another shape": json.dumps({key: {"errors": {}}}).encode(),
    }
    path.write_bytes(contents[damage])
    guarded_gpu["use"](torch_delta_rule_per_sample)
    assert "checked now" in gated_delta.resolve_backend("auto", {DIMS}, torch.bfloat16).reason
    assert "cached" in gated_delta.resolve_backend("auto", {DIMS}, torch.bfloat16).reason
    assert "checked now" in gated_delta.resolve_backend("auto", {DIMS}, torch.float16).reason


def test_fla_backend_runs_single_sequences_through_the_same_kernels(guarded_gpu, monkeypatch):
    """With the fla backend, an unpacked sequence (batch 1, no mask) computing in bf16 takes the fla path as a pack of
    one sample, so per-sample and packed runs use the same kernels; a padded batch and an fp32 call keep the layer's
    own forward."""
    guarded_gpu["use"](torch_delta_rule_per_sample)
    model = build_model(load_config("recipes/tiny-qwen3_5.yaml").model, attn_implementation="sdpa")
    assert enable_packed_forward(model, "auto", compute_dtype=torch.bfloat16) == "fla"
    seen = []

    def recording(module, hidden_states, cu_seqlens, lengths):
        assert lengths == (cu_seqlens[-1].item(),)  # the host lengths fla's chunk table is built from
        seen.append(cu_seqlens.tolist())
        return getattr(module, gated_delta.ORIGINAL_FORWARD_ATTR)(hidden_states)

    monkeypatch.setattr(gated_delta, "_fla_varlen_forward", recording)
    layer = gated_delta.gated_delta_layers(model)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(1, 9, layer.hidden_size))
        assert seen == [[0, 9]]
        layer(torch.randn(2, 9, layer.hidden_size), attention_mask=torch.ones(2, 9, dtype=torch.long))
    assert seen == [[0, 9]]
    layer(torch.randn(1, 9, layer.hidden_size))  # fp32: the torch path (fla's fp32 matmuls are TF32)
    assert seen == [[0, 9]]


def test_fp32_runs_take_the_torch_path(guarded_gpu):
    """An fp32 run never takes fla, even where fla would pass its check: fla's fp32 matmuls are TF32."""
    guarded_gpu["use"](torch_delta_rule_per_sample)
    choice = gated_delta.resolve_backend("auto", {DIMS}, torch.float32)
    assert choice.backend == "torch" and "TF32" in choice.reason and guarded_gpu["n"] == 0
    with pytest.raises(ValueError, match="TF32"):
        gated_delta.resolve_backend("fla", {DIMS}, torch.float32)
