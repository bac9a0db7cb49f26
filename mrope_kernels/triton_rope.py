"""Fused rotary kernels (Triton) and their launcher, q and k in one launch, forward and backward (the backward is the
forward with the angle negated):

- `_rope_kernel`, text mRoPE (chunked / interleaved sections, partial rotary). One program owns a block of tokens
  and every head of q and k: it reads the tokens' integer positions, computes cos/sin in fp32 once per (token, lane)
  and reuses them for all heads. No cos/sin table exists. Rotate-half pairing: lane j (< R/2) pairs with lane
  j + R/2; lanes [R, D) are copied.
- `_vision_table_kernel`, the ViT 2-D rope, from a per-token fp32 cos/sin table (`ops.vision_rope_table`: the
  tower builds it once per forward for all its blocks, forward and backward). Dense q and k run as one flat run of
  elements; strided ones (the qkv projection's views) by token and head strides, a power-of-two chunk of each
  token's elements per program. The partner lane (l ± D/2) is loaded again (an L1 hit): no padded lanes, where the
  text kernel's half tiles would pad D = 72's 36-lane halves to 64.

The launcher derives grid, strides and constexprs once per input signature (`launch_plan`, `vision_launch_plan`).
The first launch of each specialization (plan, device, every tensor's 16-byte alignment) goes through Triton's
JIT, which binds and specializes the arguments, finds or compiles the kernel and launches it; that host work
dominates a call at small T. The launcher keeps the compiled kernel the JIT returns and launches it directly from
then on, as the JIT's own last step does (`launch`), so a repeated call costs a dict hit or two and the driver's
launch (docs/performance.md). Launch hooks (profilers), Triton's debug and instrumentation modes and the
interpreter keep the JIT path on every call.

This module has no autograd and no transformers import; `mrope_kernels.ops` validates inputs and wraps it.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.compiler import CompiledKernel
from triton.knobs import HookChain
from triton.language.extra import libdevice
from triton.runtime import driver

# Lane → (position axis, frequency index) layouts, selected at compile time.
LAYOUT_CHUNKED = 0  # Qwen2/2.5-VL: lanes [0,s0) temporal, [s0,s0+s1) height, rest width; frequency index = lane
LAYOUT_INTERLEAVED = 1  # Qwen3-VL / 3.5: lane j height if j%3==1 and j<3*s1, width if j%3==2 and j<3*s2, else temporal
LAYOUT_VISION = 2  # ViT 2-D: lanes [0,D/4) row, [D/4,D/2) column; the frequency index restarts per axis (the table's)

# The interpreter runs on CPU tensors with numpy and knows nothing of libdevice; triton decides this at import time.
RUNS_IN_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

# Elements per (tokens × heads × half-lanes) tile of `_rope_kernel`: one token per program with all its heads
# (1024 half-lane elements, 2 warps) is the fastest tile on an H200 for the text shapes, near the speed of a plain
# copy of q and k; larger tiles are slower (docs/performance.md). Qwen3.5's wide pass-through copy takes 4 warps
# (`default_launch_config`).
_TILE_ELEMENTS = 1024
_MAX_HEADS_PER_TILE = 16
_MAX_ALIGN = 16  # element alignment hint cap (16 bf16 = 32 B, two 128-bit vectors)
# `_vision_table_kernel`'s tile: ~2048 elements on 4 warps, close to the speed of a plain copy of q and k for the
# ViT's 16 heads × 72 lanes on an H200; 1024-element tiles are about as fast (docs/performance.md). A strided
# token's elements run in chunks of at most 1024.
_VISION_TILE_ELEMENTS = 2048
_VISION_MAX_CHUNK = 1024
_VISION_WARPS = 4


@triton.jit
def _rotate_pairs(X, OUT, x_off, o_off, mask, cos, sin, HALF: tl.constexpr):
    """Rotate-half at the given offsets of lanes l < R/2: out[l] = x[l] cos - x[l + R/2] sin, out[l + R/2] =
    x[l + R/2] cos + x[l] sin."""
    x1 = tl.load(X + x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_off + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + o_off, (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + o_off + HALF, (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    X,
    OUT,
    x_token_offset,  # (BLOCK_T,) int64 offset of each token's first element in X
    out_token_offset,  # (BLOCK_T,) int64, same for OUT
    token_mask,  # (BLOCK_T,)
    n_heads,
    stride_x_head,
    stride_out_head,
    cos,  # (BLOCK_T, BLOCK_HALF) fp32, attention scaling folded in
    sin,  # (BLOCK_T, BLOCK_HALF) fp32, negated for the conjugate (backward) rotation
    HALF: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    COPY_PASS: tl.constexpr,
):
    """Rotate lanes [0, R) of every head of the token block (each half padded to BLOCK_HALF lanes); copy lanes
    [R, D) when COPY_PASS."""
    lanes = tl.arange(0, BLOCK_HALF)
    heads = tl.arange(0, BLOCK_H)
    lane_mask = lanes < HALF
    cos3 = cos[:, None, :]
    sin3 = sin[:, None, :]
    for head_start in range(0, n_heads, BLOCK_H):
        head = head_start + heads
        mask = token_mask[:, None, None] & (head < n_heads)[None, :, None] & lane_mask[None, None, :]
        x_off = x_token_offset[:, None, None] + (head * stride_x_head)[None, :, None] + lanes[None, None, :]
        o_off = out_token_offset[:, None, None] + (head * stride_out_head)[None, :, None] + lanes[None, None, :]
        _rotate_pairs(X, OUT, x_off, o_off, mask, cos3, sin3, HALF)
        if COPY_PASS:
            pass_lanes = tl.arange(0, BLOCK_PASS)
            pass_mask = token_mask[:, None, None] & (head < n_heads)[None, :, None]
            pass_mask = pass_mask & (pass_lanes < HEAD_DIM - ROTARY_DIM)[None, None, :]
            px_off = x_token_offset[:, None, None] + (head * stride_x_head)[None, :, None] + pass_lanes[None, None, :]
            po_off = (
                out_token_offset[:, None, None] + (head * stride_out_head)[None, :, None] + pass_lanes[None, None, :]
            )
            passthrough = tl.load(X + ROTARY_DIM + px_off, mask=pass_mask)
            tl.store(OUT + ROTARY_DIM + po_off, passthrough, mask=pass_mask)


@triton.jit
def _cos_sin(
    freq_lane,  # (L,) frequency lanes, < R/2 where lane_mask
    lane_mask,
    pos_0,  # (BLOCK_T,) fp32 positions per axis
    pos_1,
    pos_2,
    INV_FREQ,
    scaling,
    LAYOUT: tl.constexpr,
    SECTION_0: tl.constexpr,
    SECTION_1: tl.constexpr,
    SECTION_2: tl.constexpr,
    CONJUGATE: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    """(BLOCK_T, L) fp32 cos and sin of the tokens' angles at `freq_lane`, attention scaling folded in, sin negated
    for CONJUGATE. Lane → (axis, frequency index) is constexpr-driven, evaluated once per program."""
    if LAYOUT == 0:
        axis = (freq_lane >= SECTION_0).to(tl.int32) + (freq_lane >= SECTION_0 + SECTION_1).to(tl.int32)
    else:
        is_height = ((freq_lane % 3) == 1) & (freq_lane < 3 * SECTION_1)
        is_width = ((freq_lane % 3) == 2) & (freq_lane < 3 * SECTION_2)
        axis = tl.where(is_height, 1, tl.where(is_width, 2, 0))
    inv_freq = tl.load(INV_FREQ + freq_lane, mask=lane_mask, other=0.0)
    position = tl.where(
        axis[None, :] == 1, pos_1[:, None], tl.where(axis[None, :] == 2, pos_2[:, None], pos_0[:, None])
    )
    angle = position * inv_freq[None, :]  # fp32 product, as transformers computes it
    if USE_LIBDEVICE:
        cos = libdevice.cos(angle) * scaling
        sin = libdevice.sin(angle) * scaling
    else:
        cos = tl.cos(angle) * scaling
        sin = tl.sin(angle) * scaling
    if CONJUGATE:
        sin = -sin
    return cos, sin


@triton.jit
def _rope_kernel(
    Q,
    K,
    Q_OUT,
    K_OUT,
    POS,
    INV_FREQ,
    n_tokens,
    seq_len,
    n_heads_q,
    n_heads_k,
    # Token/head strides arrive divided by ALIGN and are multiplied back by the constexpr, so the compiler can prove
    # every row start is ALIGN-aligned and emit 128-bit loads even when a stride is not a multiple of 16.
    stride_q_batch,
    stride_q_seq,
    stride_q_head,
    stride_k_batch,
    stride_k_seq,
    stride_k_head,
    stride_qo_batch,
    stride_qo_seq,
    stride_qo_head,
    stride_ko_batch,
    stride_ko_seq,
    stride_ko_head,
    stride_pos_axis,
    stride_pos_batch,
    stride_pos_seq,
    scaling,
    LAYOUT: tl.constexpr,  # lane → axis mapping, fixed per model, so it folds to constants
    SECTION_0: tl.constexpr,
    SECTION_1: tl.constexpr,
    SECTION_2: tl.constexpr,
    ROTARY_DIM: tl.constexpr,  # constexpr so the x2 = x + R/2 offset is a known multiple and loads vectorize
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # R/2 padded to a power of two
    BLOCK_PASS: tl.constexpr,  # D - R padded to a power of two (pass-through lanes)
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    ALIGN: tl.constexpr,  # largest power of two (<= 16) dividing every token/head stride, in elements
    CONJUGATE: tl.constexpr,  # rotate by -angle: the backward pass (the rotation is orthogonal)
    COPY_PASS: tl.constexpr,  # R < D: copy the pass-through lanes in the same pass
    USE_LIBDEVICE: tl.constexpr,  # precise sin/cos (full range reduction, positions up to 1e5+); False in interpreter
):
    HALF: tl.constexpr = ROTARY_DIM // 2
    pid = tl.program_id(0)
    tokens = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < n_tokens
    batch = (tokens // seq_len).to(tl.int64)
    seq = (tokens % seq_len).to(tl.int64)

    pos_offset = batch * stride_pos_batch + seq * stride_pos_seq
    pos_0 = tl.load(POS + pos_offset, mask=token_mask, other=0).to(tl.float32)
    pos_1 = tl.load(POS + pos_offset + stride_pos_axis, mask=token_mask, other=0).to(tl.float32)
    pos_2 = tl.load(POS + pos_offset + 2 * stride_pos_axis, mask=token_mask, other=0).to(tl.float32)
    lanes = tl.arange(0, BLOCK_HALF)
    cos, sin = _cos_sin(
        lanes, lanes < HALF, pos_0, pos_1, pos_2, INV_FREQ, scaling,
        LAYOUT, SECTION_0, SECTION_1, SECTION_2, CONJUGATE, USE_LIBDEVICE,
    )  # fmt: skip

    q_offset = batch * (stride_q_batch * ALIGN) + seq * (stride_q_seq * ALIGN)
    qo_offset = batch * (stride_qo_batch * ALIGN) + seq * (stride_qo_seq * ALIGN)
    k_offset = batch * (stride_k_batch * ALIGN) + seq * (stride_k_seq * ALIGN)
    ko_offset = batch * (stride_ko_batch * ALIGN) + seq * (stride_ko_seq * ALIGN)
    _rotate_heads(
        Q, Q_OUT, q_offset, qo_offset, token_mask, n_heads_q, stride_q_head * ALIGN, stride_qo_head * ALIGN,
        cos, sin, HALF, ROTARY_DIM, HEAD_DIM, BLOCK_HALF, BLOCK_PASS, BLOCK_HQ, COPY_PASS,
    )  # fmt: skip
    _rotate_heads(
        K, K_OUT, k_offset, ko_offset, token_mask, n_heads_k, stride_k_head * ALIGN, stride_ko_head * ALIGN,
        cos, sin, HALF, ROTARY_DIM, HEAD_DIM, BLOCK_HALF, BLOCK_PASS, BLOCK_HK, COPY_PASS,
    )  # fmt: skip


@triton.jit
def _rotate_elements(X, OUT, x_offset, out_offset, mask, partner_shift, cos, sin):
    """out = x cos + x[partner] sin at the given element offsets (any tile shape); `sin` carries rotate-half's sign."""
    x = tl.load(X + x_offset, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(X + x_offset + partner_shift, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + out_offset, (x * cos + x_partner * sin).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _vision_table_kernel(
    Q,
    K,
    Q_OUT,
    K_OUT,
    TABLE,  # (T, D) fp32, contiguous: cos of frequency lane f at [t, f], its sin at [t, D/2 + f], f < D/2
    n_tokens,
    chunks_q,  # chunks of q's H_q · D elements per token, and of k's (tiled layout)
    chunks_k,
    # Token/head strides arrive divided by ALIGN and are multiplied back by the constexpr (as in `_rope_kernel`).
    stride_q_seq,
    stride_q_head,
    stride_k_seq,
    stride_k_head,
    stride_qo_seq,
    stride_qo_head,
    stride_ko_seq,
    stride_ko_head,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # H_q · D
    DENSE: tl.constexpr,  # q, k, q_out, k_out all dense (T, H, D) of one shape: one flat run of T · H · D elements
    BLOCK_T: tl.constexpr,
    CHUNK: tl.constexpr,  # a power of two dividing both H · D
    ALIGN: tl.constexpr,
    CONJUGATE: tl.constexpr,
):
    """The ViT 2-D rope from a cos/sin table. A token's elements, heads one after another, are numbered c = head · D
    + lane. DENSE: program p rotates flat elements [p · BLOCK_T · CHUNK, (p + 1) · BLOCK_T · CHUNK) of q and of k.
    Else program (token block, chunk) rotates elements [chunk · CHUNK, (chunk + 1) · CHUNK) of the block's tokens,
    addressed by token and head strides. The partner lane (rotate-half) is D/2 further in the first half, D/2 back
    in the second."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    if DENSE:
        element = pid.to(tl.int64) * (BLOCK_T * CHUNK) + tl.arange(0, BLOCK_T * CHUNK)
        tokens = element // ROW
        mask = tokens < n_tokens
        lane = element % HEAD_DIM
        q_offset, k_offset, qo_offset, ko_offset = element, element, element, element
        rotate_q, rotate_k = True, True
    else:
        n_chunks = tl.maximum(chunks_q, chunks_k)
        chunk = pid % n_chunks
        token_block = (pid // n_chunks) * BLOCK_T + tl.arange(0, BLOCK_T)
        column = chunk * CHUNK + tl.arange(0, CHUNK)
        head, lane_1d = column // HEAD_DIM, column % HEAD_DIM
        tokens = token_block.to(tl.int64)[:, None] + tl.zeros_like(column)[None, :]  # (BLOCK_T, CHUNK)
        lane = lane_1d[None, :] + tl.zeros_like(token_block)[:, None]
        mask = tokens < n_tokens
        q_offset = tokens * (stride_q_seq * ALIGN) + (head * (stride_q_head * ALIGN) + lane_1d)[None, :]
        k_offset = tokens * (stride_k_seq * ALIGN) + (head * (stride_k_head * ALIGN) + lane_1d)[None, :]
        qo_offset = tokens * (stride_qo_seq * ALIGN) + (head * (stride_qo_head * ALIGN) + lane_1d)[None, :]
        ko_offset = tokens * (stride_ko_seq * ALIGN) + (head * (stride_ko_head * ALIGN) + lane_1d)[None, :]
        rotate_q, rotate_k = chunk < chunks_q, chunk < chunks_k
    first_half = lane < HALF
    table_offset = tokens * HEAD_DIM + tl.where(first_half, lane, lane - HALF)
    cos = tl.load(TABLE + table_offset, mask=mask, other=0.0)
    sin = tl.load(TABLE + table_offset + HALF, mask=mask, other=0.0)
    # rotate-half: the first half takes -x2 sin, the second +x1 sin; the conjugate (backward) flips both
    sin = tl.where(first_half != CONJUGATE, -sin, sin)
    partner_shift = tl.where(first_half, HALF, -HALF)
    if rotate_q:
        _rotate_elements(Q, Q_OUT, q_offset, qo_offset, mask, partner_shift, cos, sin)
    if rotate_k:
        _rotate_elements(K, K_OUT, k_offset, ko_offset, mask, partner_shift, cos, sin)


def _largest_pow2_dividing(values: list[int], cap: int) -> int:
    align = cap
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


def default_launch_config(
    n_heads_q: int, n_heads_k: int, block_half: int, pass_lanes: int
) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_HQ, BLOCK_HK, num_warps) of `_rope_kernel`: ~_TILE_ELEMENTS per program's widest tile, the
    rotation tile (`block_half` wide) or the pass-through copy (`pass_lanes`: 256 for Qwen3.5's 192 lanes), never
    under one token; 2 warps up to twice that, 4 above. Counting the pass-through copy matters for Qwen3.5: its
    4096-element copy tile makes one token per program on 4 warps, faster than two tokens (docs/performance.md)."""
    block_hq = min(triton.next_power_of_2(n_heads_q), _MAX_HEADS_PER_TILE)
    block_hk = min(triton.next_power_of_2(n_heads_k), _MAX_HEADS_PER_TILE)
    block_t = max(1, _TILE_ELEMENTS // (block_hq * max(block_half, pass_lanes)))
    widest_tile = block_t * block_hq * max(block_half, pass_lanes)
    return block_t, block_hq, block_hk, 2 if widest_tile <= 2 * _TILE_ELEMENTS else 4


def _batch_seq_head_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """(batch, seq, head) strides of a (T, H, D) or (B, S, H, D) tensor; packed T is a batch of one."""
    return (0, *strides[:2]) if len(shape) == 3 else tuple(strides[:3])


def _position_strides(strides: tuple[int, ...]) -> tuple[int, int, int]:
    """(axis, batch, seq) strides of text positions (3, T) / (3, B, S)."""
    return (strides[0], 0, strides[1]) if len(strides) == 2 else tuple(strides)


class LaunchPlan(NamedTuple):
    """What launching a kernel takes besides its tensors, for one input signature."""

    kernel: triton.JITFunction  # `_rope_kernel` or `_vision_table_kernel`
    grid: tuple[int]
    scalars: tuple[int | float, ...]  # the arguments after the tensors: sizes, strides (and the rope's scaling)
    constexprs: dict[str, int | bool]
    num_warps: int
    kernels: dict  # `launch`'s store of this plan's compiled kernels, per specialization; empty at first


@functools.lru_cache(maxsize=1024)
def launch_plan(
    q_shape, q_strides, k_shape, k_strides, q_out_strides, k_out_strides, position_strides, dtypes,
    half, layout, sections, scaling, conjugate, block_t=None, num_warps=None, in_place=False,
):  # fmt: skip
    """The `_rope_kernel` plan of one input signature, derived once: q, q_out (T, Hq, D) or (B, S, Hq, D) shape and
    strides; k, k_out likewise; the dtypes of (q, k, q_out, k_out, positions, inv_freq), for which the plan's
    kernels are compiled; half = len(inv_freq) = R/2; scaling: a float (an int would be specialized by the JIT,
    == 1 even becomes a constexpr). in_place: q_out is q and k_out is k, so lanes [R, D) already hold their values
    and only the R rotary lanes are read and written. Every argument is a shape, stride, dtype or flag, so the plan is
    exact for any tensors that share them. `rope_launch` looks it up per call; `mrope_kernels.ops` keeps the plans
    it uses."""
    *lead, n_heads_q, head_dim = q_shape
    n_heads_k = k_shape[-2]
    seq_len = lead[-1]
    n_tokens = seq_len * (lead[0] if len(lead) == 2 else 1)
    rotary_dim = 2 * half
    copy_pass = rotary_dim < head_dim and not in_place
    block_half = triton.next_power_of_2(half)
    block_pass = triton.next_power_of_2(max(head_dim - rotary_dim, 1))
    default_block_t, block_hq, block_hk, default_warps = default_launch_config(
        n_heads_q, n_heads_k, block_half, block_pass if copy_pass else 0
    )
    tensor_strides = [
        s
        for shape, strides in (
            (q_shape, q_strides),
            (k_shape, k_strides),
            (q_shape, q_out_strides),
            (k_shape, k_out_strides),
        )
        for s in _batch_seq_head_strides(shape, strides)
    ]
    align = _largest_pow2_dividing(tensor_strides, _MAX_ALIGN)
    block_t = block_t or default_block_t
    grid = (triton.cdiv(n_tokens, block_t),)
    scalars = (
        n_tokens, seq_len, n_heads_q, n_heads_k,
        *[s // align for s in tensor_strides],
        *_position_strides(position_strides),
        float(scaling),
    )  # fmt: skip
    constexprs = dict(
        LAYOUT=layout, SECTION_0=sections[0], SECTION_1=sections[1], SECTION_2=sections[2],
        ROTARY_DIM=rotary_dim, HEAD_DIM=head_dim, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
        BLOCK_T=block_t, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, ALIGN=align,
        CONJUGATE=conjugate, COPY_PASS=copy_pass,
        USE_LIBDEVICE=not RUNS_IN_INTERPRETER,
    )  # fmt: skip
    return LaunchPlan(_rope_kernel, grid, scalars, constexprs, num_warps or default_warps, {})


@functools.lru_cache(maxsize=1024)
def vision_launch_plan(
    q_shape, q_strides, k_shape, k_strides, q_out_strides, k_out_strides, dtypes, conjugate, block_t=None,
    num_warps=None,
):  # fmt: skip
    """The `_vision_table_kernel` plan of one input signature: q, q_out (T, Hq, D) shape and strides, k, k_out
    likewise; the dtypes of (q, k, q_out, k_out, table). Dense tensors of one shape run as one flat run of elements
    (no per-token offsets, close to a copy's speed: docs/performance.md); others by token and head strides, in chunks of
    the largest power of two (<= 1024) dividing both H · D. Tiles of ~2048 elements on 4 warps."""
    n_tokens, n_heads_q, head_dim = q_shape
    row_q, row_k = n_heads_q * head_dim, k_shape[1] * head_dim
    dense_strides = (row_q, head_dim, 1)
    dense = tuple(q_shape) == tuple(k_shape) and all(
        tuple(strides) == dense_strides for strides in (q_strides, k_strides, q_out_strides, k_out_strides)
    )
    chunk = _largest_pow2_dividing([row_q, row_k], _VISION_MAX_CHUNK)
    chunks_q, chunks_k = row_q // chunk, row_k // chunk
    tensor_strides = [s for strides in (q_strides, k_strides, q_out_strides, k_out_strides) for s in strides[:2]]
    align = _largest_pow2_dividing(tensor_strides, _MAX_ALIGN)
    block_t = block_t or max(1, _VISION_TILE_ELEMENTS // chunk)
    if dense:
        grid = (triton.cdiv(n_tokens * row_q, block_t * chunk),)
    else:
        grid = (triton.cdiv(n_tokens, block_t) * max(chunks_q, chunks_k),)
    scalars = (n_tokens, chunks_q, chunks_k, *[s // align for s in tensor_strides])
    constexprs = dict(
        HEAD_DIM=head_dim, ROW=row_q, DENSE=dense, BLOCK_T=block_t, CHUNK=chunk, ALIGN=align, CONJUGATE=conjugate
    )
    return LaunchPlan(_vision_table_kernel, grid, scalars, constexprs, num_warps or _VISION_WARPS, {})


def launch(plan: LaunchPlan, *tensors: torch.Tensor) -> None:
    """Launch `plan.kernel` on tensors of the plan's signature (its pointer arguments, in order): through the JIT on
    a specialization's first call, then directly with the CompiledKernel it returned (kept in `plan.kernels`).

    Everything the JIT specializes on is fixed by the plan (its int scalars' == 1 / % 16 / int32 range, the
    constexprs, num_warps, every tensor's dtype; floats are not specialized) or is in the key: the current device
    and whether each tensor's address is a multiple of 16. The direct call passes what `JITFunction.run` passes at
    its end (Triton 3.6 and 3.9 alike): every parameter positionally in signature order, constexprs included, on
    the current device's current stream; no launch metadata and no hooks, as none is set (else the JIT path). It
    skips the JIT's check that the kernel's globals are unchanged: neither kernel reads any."""
    if not plan.grid[0]:
        return  # no tokens
    # Plain attributes, cheap to read per call (Triton reads TRITON_DEBUG and TRITON_INSTRUMENTATION_MODE into them
    # at import, not per call).
    runtime = knobs.runtime
    jit_only = (
        RUNS_IN_INTERPRETER  # the interpreter returns no CompiledKernel and runs on CPU tensors
        or _hooked(runtime.launch_enter_hook)
        or _hooked(runtime.launch_exit_hook)
        or plan.kernel.pre_run_hooks
        # Knobs the JIT folds into its own cache key (compile options, custom pass pipelines): debugging tools that
        # may be switched on mid-run, so while they are on every launch goes through the JIT.
        or runtime.debug
        or knobs.compilation.instrumentation_mode
        or runtime.add_stages_inspection_hook is not None
    )
    if not jit_only:
        device = driver.active.get_current_device()
        key = (device, *[t.data_ptr() % 16 == 0 for t in tensors])
        kernel = plan.kernels.get(key)
        if kernel is not None:
            kernel.run(
                plan.grid[0], 1, 1, driver.active.get_current_stream(device), kernel.function, kernel.packed_metadata,
                None, None, None, *tensors, *plan.scalars, *plan.constexprs.values(),
            )  # fmt: skip
            return
    kernel = plan.kernel[plan.grid](*tensors, *plan.scalars, **plan.constexprs, num_warps=plan.num_warps)
    if not jit_only:
        # Kept only if it is a CompiledKernel (not, e.g., Triton 3.9's FutureKernel of an async compile); else None
        # keeps this key on the JIT path for good.
        plan.kernels.setdefault(key, kernel if isinstance(kernel, CompiledKernel) else None)


def _hooked(hook) -> bool:
    """Whether a launch hook is set: a HookChain with calls, or (older style) any callable."""
    return hook.calls if isinstance(hook, HookChain) else hook is not None


def rope_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    layout: int,
    sections: tuple[int, int, int],
    scaling: float,
    conjugate: bool,
    block_t: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Rotate text q, k into q_out, k_out: new tensors (lanes [R, D) are copied), or q and k themselves (q_out is q
    and k_out is k: in place, only lanes [0, R) are read and written).

    q, q_out: (T, Hq, D) or (B, S, Hq, D); k, k_out: same leading dims, Hk heads; any strides with
    stride(-1) == 1; one dtype. positions: integer (3, T) / (3, B, S), any strides. inv_freq: fp32 contiguous
    (R/2,), R <= D. layout: LAYOUT_CHUNKED or LAYOUT_INTERLEAVED; sections: the three mRoPE sections as a tuple. No
    validation here: `mrope_kernels.ops` does it. block_t / num_warps override the heuristics (benchmark sweeps).
    """
    plan = launch_plan(
        q.shape, q.stride(), k.shape, k.stride(), q_out.stride(), k_out.stride(), positions.stride(),
        (q.dtype, k.dtype, q_out.dtype, k_out.dtype, positions.dtype, inv_freq.dtype), inv_freq.shape[0], layout,
        sections, float(scaling), conjugate, block_t, num_warps, q_out is q and k_out is k,
    )  # fmt: skip
    launch(plan, q, k, q_out, k_out, positions, inv_freq)


def vision_rope_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    table: torch.Tensor,
    conjugate: bool,
    block_t: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Rotate vision q, k (T, H, D), any strides with stride(-1) == 1, into q_out, k_out by the (T, D) fp32 cos/sin
    table of `ops.vision_rope_table`. No validation here. block_t / num_warps override the heuristics (sweeps)."""
    plan = vision_launch_plan(
        q.shape, q.stride(), k.shape, k.stride(), q_out.stride(), k_out.stride(),
        (q.dtype, k.dtype, q_out.dtype, k_out.dtype, table.dtype), conjugate, block_t, num_warps,
    )  # fmt: skip
    launch(plan, q, k, q_out, k_out, table)
