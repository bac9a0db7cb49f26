"""Fused rotary kernels against transformers' own rotary modules and apply functions, forward and backward.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py), so shapes stay small; the covering
set of cases is chosen so every head_dim, layout, view kind, dtype, T class and GQA ratio appears at least once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers.models.qwen2_5_vl import configuration_qwen2_5_vl as cfg_qwen25
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf_qwen25
from transformers.models.qwen3_5 import configuration_qwen3_5 as cfg_qwen35
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen35
from transformers.models.qwen3_vl import configuration_qwen3_vl as cfg_qwen3
from transformers.models.qwen3_vl import modeling_qwen3_vl as hf_qwen3

from mrope_kernels import apply_mrope, apply_vision_rope, ops, triton_rope
from mrope_kernels.reference import (
    apply_mrope_reference,
    apply_vision_rope_reference,
    rotate_by_vision_table_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[1]
FP32_RTOL = 2e-5


# --------------------------------------------------------------------------------------------------------------
# transformers' side: rotary modules built from real configs, applied with the model's own apply function
# --------------------------------------------------------------------------------------------------------------


def hf_text_rotary(family: str, head_dim: int, sections: list[int], partial: float = 1.0):
    """transformers' text rotary module of `family` (inv_freq, mrope_section and layout from its config)."""
    rope = {"rope_type": "default", "mrope_section": sections}
    if family == "qwen2_5_vl":
        config = cfg_qwen25.Qwen2_5_VLTextConfig(
            hidden_size=2 * head_dim, num_attention_heads=2, rope_parameters={**rope, "rope_theta": 1e6}
        )
        return hf_qwen25.Qwen2_5_VLRotaryEmbedding(config), hf_qwen25.apply_rotary_pos_emb, False
    if family == "qwen3_vl":
        config = cfg_qwen3.Qwen3VLTextConfig(
            hidden_size=256, num_attention_heads=2, head_dim=head_dim, rope_parameters={**rope, "rope_theta": 5e6}
        )
        return hf_qwen3.Qwen3VLTextRotaryEmbedding(config), hf_qwen3.apply_rotary_pos_emb, True
    config = cfg_qwen35.Qwen3_5TextConfig(
        hidden_size=256,
        num_attention_heads=2,
        head_dim=head_dim,
        rope_parameters={**rope, "rope_theta": 1e7, "partial_rotary_factor": partial},
    )
    return hf_qwen35.Qwen3_5TextRotaryEmbedding(config), hf_qwen35.apply_rotary_pos_emb, True


def hf_text_forward(rotary, apply, q, k, positions):
    """transformers' text rope on (B, S, H, D) q/k with (3, B, S) positions; cos/sin in q's dtype, as in the model."""
    cos, sin = rotary(q, positions)
    return apply(q, k, cos, sin, unsqueeze_dim=2)


VISION_FAMILIES = {
    "qwen2_5_vl": (cfg_qwen25.Qwen2_5_VLVisionConfig, hf_qwen25.Qwen2_5_VLVisionRotaryEmbedding, hf_qwen25),
    "qwen3_vl": (cfg_qwen3.Qwen3VLVisionConfig, hf_qwen3.Qwen3VLVisionRotaryEmbedding, hf_qwen3),
    "qwen3_5": (cfg_qwen35.Qwen3_5VisionConfig, hf_qwen35.Qwen3_5VisionRotaryEmbedding, hf_qwen35),
}


def hf_vision(family: str, head_dim: int):
    config_cls, rotary_cls, module = VISION_FAMILIES[family]
    rotary = rotary_cls(config_cls(hidden_size=2 * head_dim, num_heads=2))
    assert rotary.inv_freq.numel() == head_dim // 4
    return rotary, module.apply_rotary_pos_emb_vision


# --------------------------------------------------------------------------------------------------------------
# tolerances and inputs
# --------------------------------------------------------------------------------------------------------------


def assert_matches(ours: torch.Tensor, ref_fp32: torch.Tensor, what: str) -> None:
    """fp32: ≤ 2e-5 relative (to the reference's max magnitude). bf16/fp16: within twice the rounding of the fp32
    reference to that dtype, elementwise: relative 2 × half-ulp = eps, absolute twice the largest rounding error
    seen (for tiny values). Our result is the fp32 rotation rounded once; HF rounds cos/sin and every product."""
    assert ours.dtype != torch.float32 or ref_fp32.dtype == torch.float32
    assert not ours.isnan().any(), f"{what}: NaN in output (unwritten element?)"
    if ours.dtype == torch.float32:
        atol = FP32_RTOL * ref_fp32.abs().max().item()
        torch.testing.assert_close(ours, ref_fp32, rtol=FP32_RTOL, atol=atol, msg=lambda m: f"{what}: {m}")
        return
    rounding = (ref_fp32.to(ours.dtype).float() - ref_fp32).abs().max().item()
    eps = torch.finfo(ours.dtype).eps
    torch.testing.assert_close(ours.float(), ref_fp32, rtol=eps, atol=2 * rounding, msg=lambda m: f"{what}: {m}")


def make_qk(layout: str, n_tokens: int, heads_q: int, heads_k: int, head_dim: int, dtype):
    """q, k (T, H, D) in the requested memory layout, plus (B, S) of the leading dims.

    thd: contiguous packed; bshd_transposed: HF's (B, H, S, D) projection view transposed to (B, S, H, D);
    chunk: Qwen3.5's q from a (T, H, 2D) q/gate projection chunk (token and head strides 2D), k from a fused kv.
    """
    if layout == "thd":
        return torch.randn(n_tokens, heads_q, head_dim, device=DEVICE, dtype=dtype), torch.randn(
            n_tokens, heads_k, head_dim, device=DEVICE, dtype=dtype
        )
    if layout == "bshd_transposed":
        batch, seq = 2, n_tokens // 2
        q = torch.randn(batch, seq, heads_q, head_dim, device=DEVICE, dtype=dtype).transpose(1, 2).transpose(1, 2)
        k_heads_first = torch.randn(batch, heads_k, seq, head_dim, device=DEVICE, dtype=dtype)
        return q, k_heads_first.transpose(1, 2)
    q_and_gate = torch.randn(n_tokens, heads_q, 2 * head_dim, device=DEVICE, dtype=dtype)
    kv = torch.randn(n_tokens, 2 * heads_k, head_dim, device=DEVICE, dtype=dtype)
    return q_and_gate.chunk(2, dim=-1)[0], kv.chunk(2, dim=1)[0]


def text_positions(lead: tuple[int, ...], max_position: int) -> torch.Tensor:
    return torch.randint(0, max_position, (3, *lead), device=DEVICE)


@dataclass(frozen=True)
class TextCase:
    family: str
    n_tokens: int
    heads_q: int
    heads_k: int
    head_dim: int
    sections: tuple[int, int, int]
    layout: str = "thd"
    partial: float = 1.0
    max_position: int = 4096


TEXT_CASES = [
    TextCase("qwen2_5_vl", 1, 4, 2, 128, (16, 24, 24)),
    TextCase("qwen2_5_vl", 130, 7, 1, 64, (4, 14, 14), "bshd_transposed"),
    TextCase("qwen3_vl", 37, 8, 2, 128, (24, 20, 20), max_position=100_000),
    TextCase("qwen3_vl", 100, 4, 4, 80, (14, 13, 13), "bshd_transposed"),
    # R = D = 72: in bf16 the 36-lane halves are not whole 16-byte vectors
    TextCase("qwen3_vl", 23, 3, 1, 72, (12, 12, 12), "bshd_transposed", max_position=100_000),
    TextCase("qwen3_5", 101, 6, 2, 256, (11, 11, 10), "chunk", partial=0.25),
    TextCase("qwen3_5", 19, 3, 1, 72, (6, 6, 6), "chunk", partial=0.5, max_position=100_000),
]


def _text_inputs(case: TextCase, dtype):
    rotary, apply, interleaved = hf_text_rotary(case.family, case.head_dim, list(case.sections), case.partial)
    rotary = rotary.to(DEVICE)
    q, k = make_qk(case.layout, case.n_tokens, case.heads_q, case.heads_k, case.head_dim, dtype)
    positions = text_positions(tuple(q.shape[:-2]), case.max_position)
    return rotary, apply, interleaved, q, k, positions


def _hf_fp32(rotary, apply, q, k, positions):
    """HF forward in fp32 on (B, S, H, D) views (a packed (T, H, D) input becomes B = 1)."""
    batch_q, batch_k = (q, k) if q.dim() == 4 else (q[None], k[None])
    batch_pos = positions if positions.dim() == 3 else positions[:, None]
    out_q, out_k = hf_text_forward(rotary, apply, batch_q, batch_k, batch_pos)
    return (out_q, out_k) if q.dim() == 4 else (out_q[0], out_k[0])


# --------------------------------------------------------------------------------------------------------------
# text mRoPE
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "case", TEXT_CASES, ids=lambda c: f"{c.family}-T{c.n_tokens}-{c.heads_q}/{c.heads_k}x{c.head_dim}-{c.layout}"
)
def test_text_mrope_matches_transformers_fwd_bwd(case: TextCase, dtype):
    """apply_mrope equals transformers' rotary module + apply_rotary_pos_emb (computed in fp32) in the forward
    and in the gradients of q and k; inputs are left unmodified; outputs keep the input dtype."""
    torch.manual_seed(zlib.crc32(repr(case).encode()))  # stable across processes, unlike hash() of strings
    rotary, apply, interleaved, q, k, positions = _text_inputs(case, dtype)
    q_before, k_before = q.clone(), k.clone()
    q_ref = q.detach().float().requires_grad_()
    k_ref = k.detach().float().requires_grad_()
    ref_q, ref_k = _hf_fp32(rotary, apply, q_ref, k_ref, positions)
    grad_q, grad_k = torch.randn_like(ref_q), torch.randn_like(ref_k)
    ref_dq, ref_dk = torch.autograd.grad((ref_q, ref_k), (q_ref, k_ref), (grad_q, grad_k))

    q.requires_grad_()
    k.requires_grad_()
    out_q, out_k = apply_mrope(q, k, positions, rotary.inv_freq, case.sections, interleaved, rotary.attention_scaling)
    assert out_q.dtype == dtype and out_k.dtype == dtype
    assert_matches(out_q.detach(), ref_q.detach(), "q forward")
    assert_matches(out_k.detach(), ref_k.detach(), "k forward")
    dq, dk = torch.autograd.grad((out_q, out_k), (q, k), (grad_q.to(dtype), grad_k.to(dtype)))
    assert_matches(dq, ref_dq, "q gradient")
    assert_matches(dk, ref_dk, "k gradient")
    assert torch.equal(q.detach(), q_before) and torch.equal(k.detach(), k_before), "out-of-place modified inputs"


def test_attention_scaling_scales_cos_and_sin():
    """attention_scaling multiplies cos and sin: the output is the unscaled rotation times the factor."""
    torch.manual_seed(1)
    q, k = torch.randn(9, 2, 64, device=DEVICE), torch.randn(9, 1, 64, device=DEVICE)
    positions = text_positions((9,), 500)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 64, 2, device=DEVICE).float() / 64))
    plain = apply_mrope(q, k, positions, inv_freq, [8, 12, 12])
    scaled = apply_mrope(q, k, positions, inv_freq, [8, 12, 12], attention_scaling=0.7)
    torch.testing.assert_close(scaled[0], 0.7 * plain[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(scaled[1], 0.7 * plain[1], rtol=1e-6, atol=1e-6)


def test_reference_matches_transformers_fp32():
    """The plain-PyTorch reference (the CPU fallback) equals transformers in fp32 for chunked, interleaved,
    partial rotary and the vision 2-D rope."""
    torch.manual_seed(2)
    for case in (TEXT_CASES[1], TEXT_CASES[2], TEXT_CASES[4]):
        rotary, apply, interleaved, q, k, positions = _text_inputs(case, torch.float32)
        ref = _hf_fp32(rotary, apply, q, k, positions)
        ours = apply_mrope_reference(q, k, positions, rotary.inv_freq, case.sections, interleaved)
        assert_matches(ours[0], ref[0], f"{case.family} reference q")
        assert_matches(ours[1], ref[1], f"{case.family} reference k")
    rotary, apply = hf_vision("qwen3_vl", 72)
    q, k = torch.randn(11, 2, 72, device=DEVICE), torch.randn(11, 2, 72, device=DEVICE)
    positions = torch.randint(0, 500, (11, 2), device=DEVICE)
    cos, sin = rotary.to(DEVICE)(q, positions)
    ref = apply(q, k, cos, sin)
    ours = apply_vision_rope_reference(q, k, positions, rotary.inv_freq)
    assert_matches(ours[0], ref[0], "vision reference q")
    assert_matches(ours[1], ref[1], "vision reference k")


@pytest.mark.skipif(DEVICE != "cpu", reason="the reference fallback serves CPU tensors only")
def test_cpu_fallback_without_interpreter_matches_transformers(monkeypatch):
    """Without TRITON_INTERPRET, CPU tensors take the reference path: same forward and gradients (conjugate via
    negated positions) as transformers / the kernels."""
    monkeypatch.setattr(triton_rope, "RUNS_IN_INTERPRETER", False)
    torch.manual_seed(8)
    case = TEXT_CASES[4]
    rotary, apply, interleaved, q, k, positions = _text_inputs(case, torch.float32)
    q_ref, k_ref = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    ref = _hf_fp32(rotary, apply, q_ref, k_ref, positions)
    grads = (torch.randn_like(ref[0]), torch.randn_like(ref[1]))
    ref_grads = torch.autograd.grad(ref, (q_ref, k_ref), grads)
    q.requires_grad_()
    k.requires_grad_()
    out = apply_mrope(q, k, positions, rotary.inv_freq, case.sections, interleaved)
    out_grads = torch.autograd.grad(out, (q, k), grads)
    for ours, theirs, what in zip((*out, *out_grads), (*ref, *ref_grads), ("q", "k", "dq", "dk")):
        assert_matches(ours.detach(), theirs.detach(), f"fallback {what}")


# --------------------------------------------------------------------------------------------------------------
# vision 2-D rope
# --------------------------------------------------------------------------------------------------------------


def vision_qk(n_tokens: int, heads: int, head_dim: int, dtype, qkv_view: bool):
    """q, k (T, H, D): contiguous, or views of one (T, 3, H, D) qkv projection as the ViT attention unbinds it
    (token stride 3·H·D, k starting H·D elements after q)."""
    if qkv_view:
        qkv = torch.randn(n_tokens, 3, heads, head_dim, device=DEVICE, dtype=dtype)
        q, k, _ = qkv.unbind(1)
        return q, k
    q = torch.randn(n_tokens, heads, head_dim, device=DEVICE, dtype=dtype)
    return q, torch.randn(n_tokens, heads, head_dim, device=DEVICE, dtype=dtype)


@pytest.mark.parametrize(
    ("family", "n_tokens", "heads", "head_dim", "dtype", "qkv_view", "max_position"),
    [
        ("qwen2_5_vl", 67, 3, 80, torch.float32, False, 2000),
        ("qwen3_vl", 1, 2, 72, torch.bfloat16, False, 2000),
        ("qwen3_5", 33, 2, 64, torch.float32, False, 2000),
        ("qwen3_vl", 45, 4, 72, torch.float32, False, 2000),
        ("qwen3_5", 37, 3, 72, torch.bfloat16, True, 100_000),
        ("qwen2_5_vl", 29, 5, 80, torch.bfloat16, True, 2000),
    ],
)
def test_vision_rope_matches_transformers_fwd_bwd(family, n_tokens, heads, head_dim, dtype, qkv_view, max_position):
    """apply_vision_rope equals transformers' vision rotary module + apply_rotary_pos_emb_vision (fp32) forward
    and backward, with the frequency index restarting per axis; inputs unmodified. Heads of D = 64, 72, 80,
    contiguous and as the qkv projection's views, positions up to 1e5."""
    torch.manual_seed(3)
    rotary, apply = hf_vision(family, head_dim)
    rotary = rotary.to(DEVICE)
    q, k = vision_qk(n_tokens, heads, head_dim, dtype, qkv_view)
    positions = torch.randint(0, max_position, (n_tokens, 2), device=DEVICE)
    q_before = q.clone()
    q_ref, k_ref = q.detach().float().requires_grad_(), k.detach().float().requires_grad_()
    cos, sin = rotary(q_ref, positions)
    ref_q, ref_k = apply(q_ref, k_ref, cos, sin)
    grad_q, grad_k = torch.randn_like(ref_q), torch.randn_like(ref_k)
    ref_dq, ref_dk = torch.autograd.grad((ref_q, ref_k), (q_ref, k_ref), (grad_q, grad_k))

    q.requires_grad_()
    k.requires_grad_()
    out_q, out_k = apply_vision_rope(q, k, positions, rotary.inv_freq)
    assert_matches(out_q.detach(), ref_q.detach(), "vision q forward")
    assert_matches(out_k.detach(), ref_k.detach(), "vision k forward")
    dq, dk = torch.autograd.grad((out_q, out_k), (q, k), (grad_q.to(dtype), grad_k.to(dtype)))
    assert_matches(dq, ref_dq, "vision q gradient")
    assert_matches(dk, ref_dk, "vision k gradient")
    assert torch.equal(q.detach(), q_before)


# --------------------------------------------------------------------------------------------------------------
# the launcher writes every element
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "head_dim", "inv_len", "sections", "dtype"),
    [
        (triton_rope.LAYOUT_CHUNKED, 80, 40, (10, 15, 15), torch.float32),
        (triton_rope.LAYOUT_CHUNKED, 72, 36, (12, 12, 12), torch.bfloat16),
        (triton_rope.LAYOUT_INTERLEAVED, 256, 32, (11, 11, 10), torch.float32),
        (triton_rope.LAYOUT_INTERLEAVED, 256, 36, (12, 12, 12), torch.float16),
        (triton_rope.LAYOUT_VISION, 72, 18, None, torch.float32),
        (triton_rope.LAYOUT_VISION, 72, 18, None, torch.bfloat16),
        (triton_rope.LAYOUT_VISION, 40, 10, None, torch.float16),
        (triton_rope.LAYOUT_VISION, 56, 14, None, torch.bfloat16),
        (triton_rope.LAYOUT_VISION, 4, 1, None, torch.float32),
    ],
)
def test_launcher_writes_every_output_element(layout, head_dim, inv_len, sections, dtype):
    """Into NaN-poisoned outputs, the launchers write every element (rotary and pass-through lanes) of every head
    and token, GQA heads 5/3, R/2 a power of two or not (text: 40, 36, 32 lanes; vision: rows of 5 x 72 and 3 x 72
    elements, so chunks of 8, down to D = 4): no NaN survives and the result equals the reference."""
    torch.manual_seed(4)
    n_tokens, heads_q, heads_k = 29, 5, 3
    q = torch.randn(n_tokens, heads_q, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(n_tokens, heads_k, head_dim, device=DEVICE, dtype=dtype)
    inv_freq = torch.rand(inv_len, device=DEVICE)
    q_out = torch.full_like(q, float("nan"))
    k_out = torch.full_like(k, float("nan"))
    if layout == triton_rope.LAYOUT_VISION:
        positions = torch.randint(0, 100, (n_tokens, 2), device=DEVICE)
        ref = apply_vision_rope_reference(q.float(), k.float(), positions, inv_freq)
        table = ops.vision_rope_table(positions, inv_freq)
        triton_rope.vision_rope_launch(q, k, q_out, k_out, table, False)
    else:
        positions = text_positions((n_tokens,), 1000)
        interleaved = layout == triton_rope.LAYOUT_INTERLEAVED
        ref = apply_mrope_reference(q.float(), k.float(), positions, inv_freq, sections, interleaved)
        triton_rope.rope_launch(q, k, q_out, k_out, positions, inv_freq, layout, sections, 1.0, False)
    assert_matches(q_out, ref[0], "q")
    assert_matches(k_out, ref[1], "k")


@pytest.mark.parametrize("layout", ["qkv-view", "head-major", "gqa-padded-heads"])
def test_vision_table_kernel_follows_any_strides(layout):
    """The vision kernel addresses q, k and outputs by token and head strides, not as dense rows: views of the qkv
    projection (token stride 3·H·D), head-major tensors (what attention's backward hands back) and heads with gaps
    between them (head stride D + 8) rotate as the dense copy does, forward and conjugate; nothing outside the
    elements is written."""
    torch.manual_seed(12)
    n_tokens, heads, head_dim = 21, 3, 72
    if layout == "qkv-view":
        q, k, _ = torch.randn(n_tokens, 3, heads, head_dim, device=DEVICE, dtype=torch.bfloat16).unbind(1)
    elif layout == "head-major":
        q, k = (torch.randn(heads, n_tokens, head_dim, device=DEVICE, dtype=torch.bfloat16).transpose(0, 1)
                for _ in range(2))  # fmt: skip
    else:
        q, k = (torch.randn(n_tokens, heads, head_dim + 8, device=DEVICE, dtype=torch.bfloat16)[..., :head_dim]
                for _ in range(2))  # fmt: skip
    positions = torch.randint(0, 500, (n_tokens, 2), device=DEVICE)
    inv_freq = torch.rand(head_dim // 4, device=DEVICE)
    table = ops.vision_rope_table(positions, inv_freq)
    for conjugate in (False, True):
        q_out_base, k_out_base = (torch.full((*x.shape[:-1], head_dim + 8), float("nan"), device=DEVICE,
                                             dtype=x.dtype) for x in (q, k))  # fmt: skip
        q_out, k_out = q_out_base[..., :head_dim], k_out_base[..., :head_dim]
        triton_rope.vision_rope_launch(q, k, q_out, k_out, table, conjugate)
        dense = tuple(torch.empty_like(x.contiguous()) for x in (q, k))
        triton_rope.vision_rope_launch(q.contiguous(), k.contiguous(), *dense, table, conjugate)
        assert torch.equal(q_out, dense[0]) and torch.equal(k_out, dense[1])
        assert q_out_base[..., head_dim:].isnan().all() and k_out_base[..., head_dim:].isnan().all()
        expected = rotate_by_vision_table_reference(q.float(), k.float(), table, conjugate)
        assert_matches(q_out, expected[0], "q")
        assert_matches(k_out, expected[1], "k")


def test_vision_table_equals_transformers_cos_sin():
    """`vision_rope_table` is transformers' vision cos/sin, bit for bit: the table's columns are the first halves
    of the rotary module's (cos, sin), positions up to 1e5."""
    rotary, _ = hf_vision("qwen3_vl", 72)
    positions = torch.randint(0, 100_000, (57, 2))
    cos, sin = rotary(torch.empty(1), positions)
    table = ops.vision_rope_table(positions, rotary.inv_freq)
    assert table.shape == (57, 72) and table.is_contiguous()
    assert torch.equal(table[:, :36], cos[:, :36].float()) and torch.equal(table[:, 36:], sin[:, :36].float())


# Compiles a kernel for Hopper (sm_90) on the CPU, as `launch` would specialize it (16-byte aligned tensors), in a
# process without TRITON_INTERPRET (under it `triton.jit` gives interpreted functions, which do not compile), and
# prints, per case, the counts of each kind of global load and store in the PTX.
HOPPER_PTX = """
import collections, json, re, sys, torch, triton
from triton.backends.compiler import GPUTarget
from mrope_kernels import triton_rope

POINTERS = {"Q": "*bf16", "K": "*bf16", "Q_OUT": "*bf16", "K_OUT": "*bf16", "TABLE": "*fp32"}
accesses = {}
for name, n_tokens, heads, head_dim, token_stride, head_stride in json.loads(sys.argv[1]):
    shape, strides = (n_tokens, heads, head_dim), (token_stride, head_stride, 1)
    plan = triton_rope.vision_launch_plan(shape, strides, shape, strides, strides, strides,
                                          (torch.bfloat16,) * 4 + (torch.float32,), False)
    fn = plan.kernel
    scalar_names = [n for n in fn.arg_names if n not in POINTERS and n not in plan.constexprs]
    scalars = dict(zip(scalar_names, plan.scalars))
    signature, constexprs, attrs = {}, dict(plan.constexprs), {}
    for i, n in enumerate(fn.arg_names):
        if n in POINTERS:
            signature[n], attrs[(i,)] = POINTERS[n], [["tt.divisibility", 16]]
        elif n in constexprs:
            signature[n] = "constexpr"
        elif scalars[n] == 1:  # the JIT makes ints equal to 1 constexprs
            signature[n], constexprs[n] = "constexpr", 1
        else:
            signature[n] = "i32"
            if scalars[n] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": plan.num_warps}).asm["ptx"]
    accesses[name] = collections.Counter(re.findall(r"\\b(?:ld|st)\\.global(?:\\.nc)?\\.(?:v\\d\\.)?b\\d+", ptx))
print(json.dumps(accesses))
"""


@pytest.mark.slow
def test_vision_table_kernel_compiles_for_hopper_with_vector_accesses(tmp_path):
    """The vision kernel compiles for the H200's sm_90 and reads and writes q's and k's elements in 16-byte vectors,
    never one bf16 element (16 bits) at a time, for ViT 16x72 and 16x80 dense (one flat run), as the qkv
    projection's views and head-major (the backward's gradients), and compiles for one token (a constexpr then).
    Only the partner lanes' second read (D/2 away, an L1 hit) is per element: two loads per element, one of them
    vector, which runs at the copy floor (docs/performance.md). A head stride
    of 73 elements, whose rows cannot be aligned, is the control that shows the count can fail."""
    cases = [
        ("16x72 dense", 64, 16, 72, 16 * 72, 72),
        ("16x72 qkv view", 64, 16, 72, 3 * 16 * 72, 72),
        ("16x72 head-major", 64, 16, 72, 72, 16384 * 72),
        ("16x80 qkv view", 64, 16, 80, 3 * 16 * 80, 80),
        ("unaligned", 64, 16, 72, 16 * 73, 73),
        # one token: the JIT makes n_tokens == 1 a constexpr, which the kernel must compile with too
        ("one token dense", 1, 16, 72, 16 * 72, 72),
        ("one token qkv view", 1, 16, 72, 3 * 16 * 72, 72),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run(
        [sys.executable, "-c", HOPPER_PTX, json.dumps(cases)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    accesses = json.loads(result.stdout.splitlines()[-1])
    # Per thread, 2048-element tiles on 128 threads: 16 elements of q and of k each (two 16-byte vectors apiece), so
    # at most their 32 partner reads per element.
    for name, *_ in cases[:4]:
        counts = accesses[name]
        assert counts.get("st.global.v4.b32") == 4 and not counts.get("st.global.b16"), (name, counts)
        assert counts.get("ld.global.v4.b32", 0) >= 4 and counts.get("ld.global.b16", 0) <= 32, (name, counts)
    assert accesses["unaligned"].get("st.global.b16"), accesses["unaligned"]


# The text cases of scripts/bench_mrope.py at 16k packed tokens, and the (tokens per program, warps) its H200 sweep
# finds fastest for each (docs/performance.md): one token per program, 2 warps, except Qwen3.5's 4 warps for its
# 16 x 256-lane pass-through copy.
SWEEP_BEST = [
    ("qwen2.5-vl text 28/4x128", 28, 4, 128, 128, triton_rope.LAYOUT_CHUNKED, (1, 2)),
    ("qwen3-vl text 32/8x128", 32, 8, 128, 128, triton_rope.LAYOUT_INTERLEAVED, (1, 2)),
    ("qwen3.5 text 24/4x256 rot64", 24, 4, 256, 64, triton_rope.LAYOUT_INTERLEAVED, (1, 4)),
]


@pytest.mark.parametrize(("heads_q", "heads_k", "head_dim", "rotary_dim", "layout", "best"),
                         [case[1:] for case in SWEEP_BEST], ids=[case[0] for case in SWEEP_BEST])  # fmt: skip
def test_default_launch_configs_are_the_h200_sweeps_best(heads_q, heads_k, head_dim, rotary_dim, layout, best):
    """The launch heuristics pick, for each text anchor case, the config its GPU sweep measured fastest: a change to
    `default_launch_config` that moves one needs a new sweep (`bench_mrope --sweep`)."""
    n_tokens = 16384
    q_shape, k_shape = (n_tokens, heads_q, head_dim), (n_tokens, heads_k, head_dim)
    q_strides, k_strides = (heads_q * head_dim, head_dim, 1), (heads_k * head_dim, head_dim, 1)
    lanes = rotary_dim // 2
    sections = (lanes // 3, lanes // 3, lanes - 2 * (lanes // 3))
    dtypes = (torch.bfloat16,) * 4 + (torch.int64, torch.float32)
    plan = triton_rope.launch_plan(
        q_shape, q_strides, k_shape, k_strides, q_strides, k_strides, (n_tokens, 1), dtypes, lanes, layout,
        sections, 1.0, False,
    )  # fmt: skip
    assert (plan.constexprs["BLOCK_T"], plan.num_warps) == best


@pytest.mark.parametrize(("head_dim", "chunk", "block_t"), [(72, 128, 16), (80, 256, 8)])
def test_vision_default_tiles_are_the_measured_ones(head_dim, chunk, block_t):
    """ViT 16 heads: ~2048-element tiles on 4 warps, the measured defaults (docs/performance.md), with a chunk of
    128 elements (16 x 72 = 1152 = 9 x 128) or 256 (16 x 80 = 5 x 256) per token: a change here needs a new sweep."""
    shape, strides = (16384, 16, head_dim), (3 * 16 * head_dim, head_dim, 1)
    dtypes = (torch.bfloat16,) * 4 + (torch.float32,)
    plan = triton_rope.vision_launch_plan(shape, strides, shape, strides, strides, strides, dtypes, False)
    assert (plan.constexprs["CHUNK"], plan.constexprs["BLOCK_T"], plan.num_warps) == (chunk, block_t, 4)
    assert not plan.constexprs["DENSE"]
    dense = (16 * head_dim, head_dim, 1)
    assert triton_rope.vision_launch_plan(shape, dense, shape, dense, dense, dense, dtypes, False).constexprs["DENSE"]


def test_cached_launch_plans_and_checks_follow_the_signature():
    """Launch plans and validation verdicts are cached per (shape, strides, dtype, device) signature: calls that
    share a shape but not strides or dtype each get their own plan and match the reference, and a rejected input
    is rejected again on every call (errors are never cached)."""
    torch.manual_seed(9)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 64, 2, device=DEVICE).float() / 64))
    positions = text_positions((11,), 300)
    base_q = torch.randn(11, 4, 64, device=DEVICE)
    variants = [
        (base_q, torch.randn(11, 2, 64, device=DEVICE)),
        (torch.randn(4, 11, 64, device=DEVICE).transpose(0, 1), torch.randn(2, 11, 64, device=DEVICE).transpose(0, 1)),
        (base_q.bfloat16(), torch.randn(11, 2, 64, device=DEVICE, dtype=torch.bfloat16)),
        (base_q, torch.randn(11, 2, 64, device=DEVICE)),
    ]
    for q, k in variants:
        expected = apply_mrope_reference(q.float(), k.float(), positions, inv_freq, (8, 12, 12), True)
        out = apply_mrope(q, k, positions, inv_freq, [8, 12, 12], interleaved=True)
        assert out[0].stride() == q.stride() and out[1].stride() == k.stride()
        assert_matches(out[0], expected[0], "q")
        assert_matches(out[1], expected[1], "k")
    for _ in range(2):
        with pytest.raises(ValueError, match="sums to"):
            apply_mrope(base_q, variants[0][1], positions, inv_freq, [8, 12, 11])


def test_signatures_kept_are_bounded_oldest_out_first(monkeypatch):
    """Validated signatures (with their launch plans) are kept up to a bound, the oldest dropped first (packs of new
    lengths keep adding signatures); a call whose signature was dropped is validated and planned again."""
    monkeypatch.setattr(ops, "_ROPES", {})
    monkeypatch.setattr(ops, "_MAX_ROPES", 2)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 64, 2, device=DEVICE).float() / 64))
    for n_tokens in (5, 6, 7, 5):
        q, k = torch.randn(n_tokens, 4, 64, device=DEVICE), torch.randn(n_tokens, 2, 64, device=DEVICE)
        positions = text_positions((n_tokens,), 300)
        expected = apply_mrope_reference(q, k, positions, inv_freq, (8, 12, 12), True)
        out = apply_mrope(q, k, positions, inv_freq, [8, 12, 12], interleaved=True)
        assert_matches(out[0], expected[0], "q")
        assert_matches(out[1], expected[1], "k")
        assert len(ops._ROPES) <= 2
    assert sorted(key[0][0] for key in ops._ROPES) == [5, 7]  # key[0]: q's shape


def test_backward_is_planned_per_gradient_layout():
    """The backward's launch plan follows the incoming gradients' strides: one graph differentiated twice with the
    same gradients, dense and as transposed views, gives the reference gradients both times."""
    torch.manual_seed(11)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 64, 2, device=DEVICE).float() / 64))
    positions = text_positions((11,), 300)
    q = torch.randn(11, 4, 64, device=DEVICE, requires_grad=True)
    k = torch.randn(11, 2, 64, device=DEVICE, requires_grad=True)
    grads = (torch.randn(11, 4, 64, device=DEVICE), torch.randn(11, 2, 64, device=DEVICE))
    reference = apply_mrope_reference(q, k, positions, inv_freq, (8, 12, 12), True)
    expected = torch.autograd.grad(reference, (q, k), grads)
    out = apply_mrope(q, k, positions, inv_freq, [8, 12, 12], interleaved=True)
    transposed = tuple(g.transpose(0, 1).contiguous().transpose(0, 1) for g in grads)
    for layout in (grads, transposed):
        got = torch.autograd.grad(out, (q, k), layout, retain_graph=True)
        assert_matches(got[0], expected[0], "q gradient")
        assert_matches(got[1], expected[1], "k gradient")


def test_heads_first_rotates_transformers_layout_as_is():
    """heads_first takes (B, H, S, D) (transformers' layout) and gives exactly what the (B, S, H, D) call on the
    transposed views gives, forward and backward, with outputs in the inputs' layout; 3-D q and k are refused."""
    torch.manual_seed(10)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 64, 2, device=DEVICE).float() / 64))
    positions = text_positions((2, 7), 300)
    q = torch.randn(2, 7, 4, 64, device=DEVICE).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 7, 2, 64, device=DEVICE).transpose(1, 2).requires_grad_()
    grads = (torch.randn(2, 4, 7, 64, device=DEVICE), torch.randn(2, 2, 7, 64, device=DEVICE))
    out = apply_mrope(q, k, positions, inv_freq, [8, 12, 12], interleaved=True, heads_first=True)
    views = apply_mrope(q.transpose(1, 2), k.transpose(1, 2), positions, inv_freq, [8, 12, 12], interleaved=True)
    for got, want, x in zip(out, views, (q, k)):
        assert got.stride() == x.stride()
        assert torch.equal(got, want.transpose(1, 2))
    got_grads = torch.autograd.grad(out, (q, k), grads)
    want_grads = torch.autograd.grad(views, (q, k), tuple(g.transpose(1, 2) for g in grads))
    assert all(torch.equal(got, want) for got, want in zip(got_grads, want_grads))
    with pytest.raises(ValueError, match=r"heads_first q and k must be \(B, H, S, D\)"):
        apply_mrope(q[0], k[0], positions[:, 0], inv_freq, [8, 12, 12], heads_first=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads_first", [False, True], ids=["bshd", "bhsd"])
def test_in_place_partial_rotary_equals_out_of_place(dtype, heads_first):
    """inplace=True (Qwen3.5's partial rotary: 16 of 48 lanes here) rotates q and k themselves: the returned tensors
    are the inputs' storage, bit for bit the out-of-place result in the forward (the pass-through lanes keep their
    values) and in both gradients; autograd sees the write (the version counter moves)."""
    torch.manual_seed(11)
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, 16, 2, device=DEVICE).float() / 16))
    positions = text_positions((2, 5), 5000)
    shape_q, shape_k = ((2, 3, 5, 48), (2, 1, 5, 48)) if heads_first else ((2, 5, 3, 48), (2, 5, 1, 48))
    q_leaf = torch.randn(shape_q, device=DEVICE, dtype=dtype, requires_grad=True)
    k_leaf = torch.randn(shape_k, device=DEVICE, dtype=dtype, requires_grad=True)
    grads = (torch.randn(shape_q, device=DEVICE, dtype=dtype), torch.randn(shape_k, device=DEVICE, dtype=dtype))
    args = (positions, inv_freq, [3, 3, 2], True)
    want = apply_mrope(q_leaf, k_leaf, *args, heads_first=heads_first)
    want_grads = torch.autograd.grad(want, (q_leaf, k_leaf), grads)
    q, k = q_leaf * 1, k_leaf * 1
    version, pointers = q._version, (q.data_ptr(), k.data_ptr())
    got = apply_mrope(q, k, *args, heads_first=heads_first, inplace=True)
    assert (got[0].data_ptr(), got[1].data_ptr()) == pointers and q._version > version
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got_grads = torch.autograd.grad(got, (q_leaf, k_leaf), grads)
    assert torch.equal(got_grads[0], want_grads[0]) and torch.equal(got_grads[1], want_grads[1])


def test_in_place_refuses_what_would_make_a_gradient_wrong(monkeypatch):
    """In place on a leaf that requires grad raises, so does the backward of an op whose saved output the rope
    overwrote (autograd's version check), and under torch.compile inplace=True is refused by name."""
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, 16, 2, device=DEVICE).float() / 16))
    positions = text_positions((4,), 100)
    q = torch.randn(4, 2, 48, device=DEVICE, requires_grad=True)
    k = torch.randn(4, 1, 48, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf"):
        apply_mrope(q, k, positions, inv_freq, [3, 3, 2], True, inplace=True)
    q_saved, k_saved = q.exp(), k.exp()  # exp saves its output for its backward
    out = apply_mrope(q_saved, k_saved, positions, inv_freq, [3, 3, 2], True, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out[0].sum() + out[1].sum(), (q, k))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(ValueError, match=r"apply_mrope\(inplace=True\) runs eagerly only"):
        apply_mrope(q * 1, k * 1, positions, inv_freq, [3, 3, 2], True, inplace=True)


def test_second_order_gradients_are_refused_not_silently_wrong():
    """The kernel's backward is not differentiable: differentiating through it again raises instead of returning a
    gradient that silently lacks its second-order terms."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 64, 2, device=DEVICE).float() / 64))
    q = torch.randn(5, 2, 64, device=DEVICE, requires_grad=True)
    k = torch.randn(5, 1, 64, device=DEVICE, requires_grad=True)
    out_q, _ = apply_mrope(q, k, text_positions((5,), 100), inv_freq, [8, 12, 12])
    (grad_q,) = torch.autograd.grad((out_q**2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad_q.sum().backward()


def test_torch_compile_fullgraph_traces_without_graph_break():
    """torch.compile(fullgraph=True) traces apply_mrope and apply_vision_rope (custom ops with fake impls and
    registered autograd) and gives the eager results, forward and backward."""
    torch.manual_seed(6)
    q = torch.randn(13, 4, 64, device=DEVICE, requires_grad=True)
    k = torch.randn(13, 2, 64, device=DEVICE, requires_grad=True)
    positions = text_positions((13,), 300)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 64, 2, device=DEVICE).float() / 64))
    vision_positions = torch.randint(0, 30, (13, 2), device=DEVICE)
    vision_inv = inv_freq[:16].contiguous()

    def fn(q, k):
        text_q, text_k = apply_mrope(q, k, positions, inv_freq, [8, 12, 12], interleaved=True)
        vis_q, vis_k = apply_vision_rope(q, k, vision_positions, vision_inv)
        return (text_q * vis_q).sum() + (text_k * vis_k).sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager_loss = fn(q, k)
    eager_grads = torch.autograd.grad(eager_loss, (q, k))
    compiled_loss = compiled(q, k)
    compiled_grads = torch.autograd.grad(compiled_loss, (q, k))
    torch.testing.assert_close(compiled_loss, eager_loss)
    torch.testing.assert_close(compiled_grads, eager_grads)


# --------------------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------------------


def _good_text():
    q, k = torch.randn(5, 2, 64), torch.randn(5, 1, 64)
    return {"q": q, "k": k, "positions": torch.zeros(3, 5, dtype=torch.long), "inv_freq": torch.rand(32)}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mrope_section": [8, 8, 8]}, "sums to 24"),
        ({"mrope_section": [16, 16]}, "3 non-negative ints"),
        ({"inv_freq": torch.rand(40), "mrope_section": [10, 15, 15]}, "exceeds head_dim"),
        ({"q": torch.randn(5, 2, 63), "k": torch.randn(5, 1, 63)}, "must be even"),
        ({"positions": torch.zeros(3, 4, dtype=torch.long)}, "positions has shape"),
        ({"positions": torch.zeros(5, dtype=torch.long)}, "positions has shape"),
        ({"positions": torch.zeros(3, 5)}, "integer tensor"),
        ({"k": torch.randn(5, 1, 64, dtype=torch.bfloat16)}, "share one dtype"),
        ({"inv_freq": torch.rand(32, dtype=torch.float64)}, "float32"),
        ({"inv_freq": torch.rand(32, device="meta")}, "one device"),
        ({"q": torch.randn(5, 64, 2).transpose(1, 2)}, "contiguous last"),
        ({"k": torch.randn(6, 1, 64)}, "share leading"),
        ({"k": torch.randn(1, 5, 1, 64)}, "both be"),
        ({"mrope_section": None}, "3 non-negative ints"),
        ({"positions": [[0] * 5] * 3}, "must be a torch.Tensor"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_text_input_raises_value_error(change, message):
    """Each malformed apply_mrope input raises ValueError naming the problem (before any kernel runs)."""
    args = {**_good_text(), "mrope_section": [8, 12, 12], **change}
    with pytest.raises(ValueError, match=message):
        apply_mrope(args["q"], args["k"], args["positions"], args["inv_freq"], args["mrope_section"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"inv_freq": torch.rand(8)}, "inv_freq of length head_dim/4"),
        ({"positions": torch.zeros(2, 5, dtype=torch.long)}, r"\(T, 2\)"),
        ({"positions": torch.zeros(5, 2, dtype=torch.float32)}, "integer tensor"),
        ({"q": torch.randn(1, 5, 2, 64), "k": torch.randn(1, 5, 2, 64)}, r"\(T, H, D\)"),
        ({"k": torch.randn(5, 2, 64, dtype=torch.float16)}, "share one dtype"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_vision_input_raises_value_error(change, message):
    """Each malformed apply_vision_rope input raises ValueError naming the problem."""
    args = {
        "q": torch.randn(5, 2, 64),
        "k": torch.randn(5, 2, 64),
        "positions": torch.zeros(5, 2, dtype=torch.long),
        "inv_freq": torch.rand(16),
        **change,
    }
    with pytest.raises(ValueError, match=message):
        apply_vision_rope(args["q"], args["k"], args["positions"], args["inv_freq"])


# --------------------------------------------------------------------------------------------------------------
# GPU: the real kernels at benchmark shapes
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [
        TextCase("qwen2_5_vl", 16384, 28, 4, 128, (16, 24, 24), "bshd_transposed"),
        TextCase("qwen3_5", 16384, 24, 4, 256, (11, 11, 10), "chunk", partial=0.25, max_position=100_000),
    ],
    ids=["qwen2.5-vl-7b", "qwen3.5"],
)
def test_gpu_text_large_matches_transformers(case: TextCase):
    """At T = 16384 in bf16 on the GPU (real kernels, libdevice sin/cos), forward and backward stay within bf16
    rounding of transformers in fp32, including positions up to 1e5."""
    test_text_mrope_matches_transformers_fwd_bwd(case, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_large_positions_fp32_accuracy():
    """fp32 at positions up to 1e5 on the GPU: sin/cos of large angles keep full range reduction (2e-5)."""
    test_text_mrope_matches_transformers_fwd_bwd(
        TextCase("qwen3_vl", 4096, 8, 2, 128, (24, 20, 20), max_position=100_000), torch.float32
    )


@pytest.mark.gpu
@pytest.mark.parametrize("qkv_view", [False, True], ids=["contiguous", "qkv-view"])
@pytest.mark.parametrize(("family", "head_dim"), [("qwen3_vl", 72), ("qwen2_5_vl", 80)], ids=["16x72", "16x80"])
def test_gpu_vision_large_matches_transformers(family, head_dim, qkv_view):
    """ViT 16x72 and 16x80 at T = 16384 in bf16 on the GPU, contiguous and as views of the qkv projection, match
    transformers' vision rope (fp32) fwd and bwd."""
    test_vision_rope_matches_transformers_fwd_bwd(family, 16384, 16, head_dim, torch.bfloat16, qkv_view, 2000)
