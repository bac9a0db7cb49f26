"""Fused rotary kernel (Triton) and its launcher: text mRoPE (chunked / interleaved, partial rotary) and the
2-D vision rope, q and k in one launch, forward and backward (the backward is the forward with the angle negated).

One program owns a block of tokens and every head of q and k: it reads the tokens' integer positions, computes
cos/sin in fp32 once per (token, lane of its tile) and reuses them for all heads. No cos/sin table exists anywhere.
Rotate-half pairing: lane j (< R/2) pairs with lane j + R/2; lanes [R, D) are copied.

The launcher derives grid, strides and constexprs once per input signature (`launch_plan`). The first launch of each
specialization (plan, device, every tensor's 16-byte alignment) goes through Triton's JIT, which binds and
specializes the arguments, finds or compiles the kernel and launches it, ~50 µs of host time per call on an H200
host with Triton 3.6; the launcher keeps the compiled kernel it returns and launches it directly from then on, as
the JIT's own last step does (`launch`). So a repeated call costs a dict hit or two and the driver's launch. Launch
hooks (profilers), Triton's debug and instrumentation modes and the interpreter keep the JIT path on every call.

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
LAYOUT_VISION = 2  # ViT 2-D: lanes [0,R/4) row, [R/4,R/2) column; the frequency index restarts per axis

# The interpreter runs on CPU tensors with numpy and knows nothing of libdevice; triton decides this at import time.
RUNS_IN_INTERPRETER = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

# How a program's tile covers the rotary lanes of a head (the `TILE` constexpr):
TILE_HALVES = 0  # lanes [0, R/2) and their partners [R/2, R), each half padded to a power of two (`_rotate_heads`)
TILE_ROWS = 1  # the whole row [0, R), padded, the partner lane gathered in registers (`_rotate_rows`; R == D only)
TILE_SPLIT = 2  # halves as a power-of-two part and its tail, R/2 = 36 as 32 + 4: no padded lanes (`_rotate_heads`)

# Elements per (tokens × heads × half-lanes) tile. Swept on an H200 at 16k tokens (BLOCK_T 1-16, 2-8 warps): one
# token per program with all heads (1024 half-lane elements, 2 warps) was fastest in four of the five anchor cases,
# 3-7% over the copy floor for three of them (docs/benchmarks.md); larger tiles were 5-30% slower.
_TILE_ELEMENTS = 1024
_MAX_HEADS_PER_TILE = 16
_MAX_ALIGN = 16  # element alignment hint cap (16 bf16 = 32 B, two 128-bit vectors)


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
    cos_tail,  # (BLOCK_T, BLOCK_TAIL) fp32: lanes [BLOCK_HALF, R/2) when BLOCK_TAIL > 0 (else unused)
    sin_tail,
    HALF: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    COPY_PASS: tl.constexpr,
):
    """Rotate lanes [0, R) of every head of the token block: lanes [0, BLOCK_HALF) of each half (all of it,
    padded, when BLOCK_TAIL is 0), then its tail [BLOCK_HALF, R/2); copy lanes [R, D) when COPY_PASS."""
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
        if BLOCK_TAIL > 0:
            tail = BLOCK_HALF + tl.arange(0, BLOCK_TAIL)
            tail_mask = token_mask[:, None, None] & (head < n_heads)[None, :, None] & (tail < HALF)[None, None, :]
            xt_off = x_token_offset[:, None, None] + (head * stride_x_head)[None, :, None] + tail[None, None, :]
            ot_off = out_token_offset[:, None, None] + (head * stride_out_head)[None, :, None] + tail[None, None, :]
            _rotate_pairs(X, OUT, xt_off, ot_off, tail_mask, cos_tail[:, None, :], sin_tail[:, None, :], HALF)
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
def _rotate_rows(
    X,
    OUT,
    x_token_offset,  # (BLOCK_T,) int64 offset of each token's first element in X
    out_token_offset,  # (BLOCK_T,) int64, same for OUT
    token_mask,  # (BLOCK_T,)
    n_heads,
    stride_x_head,
    stride_out_head,
    cos,  # (BLOCK_T, BLOCK_LANES) fp32 per lane of the whole head
    sin,  # (BLOCK_T, BLOCK_LANES) fp32, already negated on the first half (and again for CONJUGATE)
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_LANES: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rotate whole heads (R == D) as one row each: out[l] = x[l] cos[l] + x[l ± R/2] sin[l].

    Used when R/2 elements are not a multiple of 16 bytes (ViT D=72: 36 lanes): split into halves, the second
    half starts mid-vector and both halves load and store in 8-byte pieces. Here the row load and the store are
    whole 16-byte vectors, and each lane's partner (l ± R/2) is gathered from the loaded row in registers
    (`tl.gather`), not loaded again. On an H200 (fwd+bwd at 16k tokens, 16 heads) this is 1.17x the copy floor on
    2 warps (1.37x on 4); a second, per-lane-offset load of the row (a gather of 2-byte loads) was 1.44x, and two
    constant-offset loads masked to one half each 1.64x (on 4 warps).
    """
    lanes = tl.arange(0, BLOCK_LANES)
    heads = tl.arange(0, BLOCK_H)
    partner = tl.where(lanes < HALF, lanes + HALF, lanes - HALF)  # padding lanes (>= R) pick a lane that exists
    lane_mask = lanes < HEAD_DIM
    cos3 = cos[:, None, :]
    sin3 = sin[:, None, :]
    for head_start in range(0, n_heads, BLOCK_H):
        head = head_start + heads
        mask = token_mask[:, None, None] & (head < n_heads)[None, :, None] & lane_mask[None, None, :]
        x_off = x_token_offset[:, None, None] + (head * stride_x_head)[None, :, None] + lanes[None, None, :]
        o_off = out_token_offset[:, None, None] + (head * stride_out_head)[None, :, None] + lanes[None, None, :]
        x = tl.load(X + x_off, mask=mask, other=0.0).to(tl.float32)
        partner_index = tl.broadcast_to(partner[None, None, :], (x.shape[0], x.shape[1], x.shape[2]))
        x_partner = tl.gather(x, partner_index, axis=2)
        tl.store(OUT + o_off, (x * cos3 + x_partner * sin3).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _cos_sin(
    freq_lane,  # (L,) frequency lanes, < R/2 where lane_mask
    lane_mask,
    pos_0,  # (BLOCK_T,) fp32 positions per axis (pos_2 unused by the vision layout)
    pos_1,
    pos_2,
    INV_FREQ,
    scaling,
    LAYOUT: tl.constexpr,
    SECTION_0: tl.constexpr,
    SECTION_1: tl.constexpr,
    SECTION_2: tl.constexpr,
    HALF: tl.constexpr,
    CONJUGATE: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    """(BLOCK_T, L) fp32 cos and sin of the tokens' angles at `freq_lane`, attention scaling folded in, sin negated
    for CONJUGATE. Lane → (axis, frequency index) is constexpr-driven, evaluated once per program."""
    if LAYOUT == 0:
        axis = (freq_lane >= SECTION_0).to(tl.int32) + (freq_lane >= SECTION_0 + SECTION_1).to(tl.int32)
        freq_index = freq_lane
    elif LAYOUT == 1:
        is_height = ((freq_lane % 3) == 1) & (freq_lane < 3 * SECTION_1)
        is_width = ((freq_lane % 3) == 2) & (freq_lane < 3 * SECTION_2)
        axis = tl.where(is_height, 1, tl.where(is_width, 2, 0))
        freq_index = freq_lane
    else:
        axis = (freq_lane >= HALF // 2).to(tl.int32)
        freq_index = freq_lane - axis * (HALF // 2)
    inv_freq = tl.load(INV_FREQ + freq_index, mask=lane_mask, other=0.0)
    if LAYOUT == 2:
        position = tl.where(axis[None, :] == 1, pos_1[:, None], pos_0[:, None])
    else:
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
    # every row start is ALIGN-aligned and emit 128-bit loads even when a stride is not a multiple of 16 (ViT D=72).
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
    TILE: tl.constexpr,  # TILE_HALVES, TILE_ROWS or TILE_SPLIT: how a tile covers a head's rotary lanes
    BLOCK_LANES: tl.constexpr,  # lanes per tile: R/2 (halves) or R (rows) padded to a power of two, or R/2's
    # largest power of two (split)
    BLOCK_TAIL: tl.constexpr,  # split: the rest of R/2, padded to a power of two (0 for the other tiles)
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
    if LAYOUT == 2:
        pos_2 = pos_1  # the vision rope has two axes
    else:
        pos_2 = tl.load(POS + pos_offset + 2 * stride_pos_axis, mask=token_mask, other=0).to(tl.float32)

    # A row tile spans both halves: lane l and l + R/2 share frequency lane l.
    lanes = tl.arange(0, BLOCK_LANES)
    if TILE == 1:
        freq_lane = tl.where(lanes < HALF, lanes, lanes - HALF)
        lane_mask = lanes < ROTARY_DIM
    else:
        freq_lane = lanes
        lane_mask = lanes < HALF
    cos, sin = _cos_sin(
        freq_lane, lane_mask, pos_0, pos_1, pos_2, INV_FREQ, scaling,
        LAYOUT, SECTION_0, SECTION_1, SECTION_2, HALF, CONJUGATE, USE_LIBDEVICE,
    )  # fmt: skip
    if TILE == 1:  # rotate-half: the first half takes -x2 sin, the second +x1 sin
        sin = tl.where(lanes[None, :] < HALF, -sin, sin)
    if TILE == 2:
        tail = BLOCK_LANES + tl.arange(0, BLOCK_TAIL)
        cos_tail, sin_tail = _cos_sin(
            tail, tail < HALF, pos_0, pos_1, pos_2, INV_FREQ, scaling,
            LAYOUT, SECTION_0, SECTION_1, SECTION_2, HALF, CONJUGATE, USE_LIBDEVICE,
        )  # fmt: skip
    else:
        cos_tail, sin_tail = cos, sin  # unused

    q_offset = batch * (stride_q_batch * ALIGN) + seq * (stride_q_seq * ALIGN)
    qo_offset = batch * (stride_qo_batch * ALIGN) + seq * (stride_qo_seq * ALIGN)
    k_offset = batch * (stride_k_batch * ALIGN) + seq * (stride_k_seq * ALIGN)
    ko_offset = batch * (stride_ko_batch * ALIGN) + seq * (stride_ko_seq * ALIGN)
    if TILE == 1:
        _rotate_rows(
            Q, Q_OUT, q_offset, qo_offset, token_mask, n_heads_q, stride_q_head * ALIGN, stride_qo_head * ALIGN,
            cos, sin, HALF, HEAD_DIM, BLOCK_LANES, BLOCK_HQ,
        )  # fmt: skip
        _rotate_rows(
            K, K_OUT, k_offset, ko_offset, token_mask, n_heads_k, stride_k_head * ALIGN, stride_ko_head * ALIGN,
            cos, sin, HALF, HEAD_DIM, BLOCK_LANES, BLOCK_HK,
        )  # fmt: skip
    else:
        _rotate_heads(
            Q, Q_OUT, q_offset, qo_offset, token_mask, n_heads_q, stride_q_head * ALIGN, stride_qo_head * ALIGN,
            cos, sin, cos_tail, sin_tail, HALF, ROTARY_DIM, HEAD_DIM, BLOCK_LANES, BLOCK_TAIL, BLOCK_PASS, BLOCK_HQ,
            COPY_PASS,
        )  # fmt: skip
        _rotate_heads(
            K, K_OUT, k_offset, ko_offset, token_mask, n_heads_k, stride_k_head * ALIGN, stride_ko_head * ALIGN,
            cos, sin, cos_tail, sin_tail, HALF, ROTARY_DIM, HEAD_DIM, BLOCK_LANES, BLOCK_TAIL, BLOCK_PASS, BLOCK_HK,
            COPY_PASS,
        )  # fmt: skip


def _largest_pow2_dividing(values: list[int], cap: int) -> int:
    align = cap
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


def default_tile(rotary_dim: int, head_dim: int, element_size: int) -> int:
    """The tile kind: TILE_ROWS only when the rotary half (R/2 elements) is not a whole number of 16-byte vectors,
    so the second half would start mid-vector (ViT D=72 in bf16), else TILE_HALVES: two half tiles are at the copy
    floor (text D=128, ViT D=80) and handle partial rotary. TILE_SPLIT (no padded lanes) times the same as the row
    tile for ViT 16x72 on an H200 (forward 53.3 µs on 4 warps against 53.4 on 2), so it stays a sweep option."""
    if rotary_dim == head_dim and (rotary_dim // 2 * element_size) % 16 != 0:
        return TILE_ROWS
    return TILE_HALVES


def tile_lanes(tile: int, rotary_dim: int) -> tuple[int, int]:
    """(BLOCK_LANES, BLOCK_TAIL) of a tile kind: the power-of-two lane counts its aranges span."""
    half = rotary_dim // 2
    if tile == TILE_ROWS:
        return triton.next_power_of_2(rotary_dim), 0
    if tile == TILE_SPLIT and half & (half - 1):  # R/2 not a power of two: its largest one, then the rest
        main = 1 << (half.bit_length() - 1)
        return main, triton.next_power_of_2(half - main)
    return triton.next_power_of_2(half), 0


def default_launch_config(
    n_heads_q: int, n_heads_k: int, block_lanes: int, pass_lanes: int
) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_HQ, BLOCK_HK, num_warps): ~_TILE_ELEMENTS per program's widest tile, the rotation tile
    (`block_lanes` wide) or the pass-through copy (`pass_lanes`: 256 for Qwen3.5's 192 lanes), never under one token;
    2 warps up to twice that, 4 above. The H200 sweep of 2026-12-02 (docs/benchmarks.md, sixteenth session): ViT
    16x72's row tile (2048 elements) is 15% faster on 2 warps than on 4, and Qwen3.5's one-token tile with its
    4096-element copy 9% faster than the two-token tile it had."""
    block_hq = min(triton.next_power_of_2(n_heads_q), _MAX_HEADS_PER_TILE)
    block_hk = min(triton.next_power_of_2(n_heads_k), _MAX_HEADS_PER_TILE)
    block_t = max(1, _TILE_ELEMENTS // (block_hq * max(block_lanes, pass_lanes)))
    widest_tile = block_t * block_hq * max(block_lanes, pass_lanes)
    return block_t, block_hq, block_hk, 2 if widest_tile <= 2 * _TILE_ELEMENTS else 4


def _batch_seq_head_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """(batch, seq, head) strides of a (T, H, D) or (B, S, H, D) tensor; packed T is a batch of one."""
    return (0, *strides[:2]) if len(shape) == 3 else tuple(strides[:3])


def _position_strides(strides: tuple[int, ...], layout: int) -> tuple[int, int, int]:
    """(axis, batch, seq) strides of text (3, T) / (3, B, S) or vision (T, 2) positions."""
    if layout == LAYOUT_VISION:
        return strides[1], 0, strides[0]
    return (strides[0], 0, strides[1]) if len(strides) == 2 else tuple(strides)


class LaunchPlan(NamedTuple):
    """What launching `_rope_kernel` takes besides the six tensors and scaling, for one input signature."""

    grid: tuple[int]
    scalars: tuple[int, ...]  # the int arguments after the tensors: sizes and strides
    constexprs: dict[str, int | bool]
    num_warps: int
    kernels: dict  # `launch`'s store of this plan's compiled kernels, per specialization; empty at first


@functools.lru_cache(maxsize=1024)
def launch_plan(
    q_shape, q_strides, k_shape, k_strides, q_out_strides, k_out_strides, position_strides, dtypes,
    half_or_quarter, layout, sections, conjugate, block_t=None, num_warps=None, tile=None,
):  # fmt: skip
    """The launch plan of one input signature, derived once: q, q_out (T, Hq, D) or (B, S, Hq, D) shape and strides;
    k, k_out likewise; the dtypes of (q, k, q_out, k_out, positions, inv_freq), for which the plan's kernels are
    compiled. Every argument is a shape, stride, dtype or flag, so the plan is exact for any tensors that share them.
    `rope_launch` looks it up per call; `mrope_kernels.ops` keeps the plans it uses."""
    *lead, n_heads_q, head_dim = q_shape
    n_heads_k = k_shape[-2]
    seq_len = lead[-1]
    n_tokens = seq_len * (lead[0] if len(lead) == 2 else 1)
    rotary_dim = 4 * half_or_quarter if layout == LAYOUT_VISION else 2 * half_or_quarter
    copy_pass = rotary_dim < head_dim
    if tile is None:
        tile = default_tile(rotary_dim, head_dim, dtypes[0].itemsize)
    if tile == TILE_ROWS and rotary_dim < head_dim:
        raise ValueError("row tiles rotate whole heads: they need R == D")
    block_lanes, block_tail = tile_lanes(tile, rotary_dim)
    block_pass = triton.next_power_of_2(max(head_dim - rotary_dim, 1))
    default_block_t, block_hq, block_hk, default_warps = default_launch_config(
        n_heads_q, n_heads_k, block_lanes, block_pass if copy_pass else 0
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
        *_position_strides(position_strides, layout),
    )  # fmt: skip
    constexprs = dict(
        LAYOUT=layout, SECTION_0=sections[0], SECTION_1=sections[1], SECTION_2=sections[2],
        ROTARY_DIM=rotary_dim, HEAD_DIM=head_dim, TILE=tile,
        BLOCK_LANES=block_lanes, BLOCK_TAIL=block_tail, BLOCK_PASS=block_pass,
        BLOCK_T=block_t, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, ALIGN=align,
        CONJUGATE=conjugate, COPY_PASS=copy_pass,
        USE_LIBDEVICE=not RUNS_IN_INTERPRETER,
    )  # fmt: skip
    return LaunchPlan(grid, scalars, constexprs, num_warps or default_warps, {})


def launch(plan: LaunchPlan, q, k, q_out, k_out, positions, inv_freq, scaling: float) -> None:
    """Launch `_rope_kernel` as `plan` says on tensors of its signature: through the JIT on a specialization's first
    call, then directly with the CompiledKernel it returned (kept in `plan.kernels`). scaling: a float (an int would
    be specialized by the JIT, == 1 even becomes a constexpr, beyond the key).

    Everything the JIT specializes on is fixed by the plan (its int scalars' == 1 / % 16 / int32 range, the
    constexprs, num_warps, every tensor's dtype; scaling is a float, not specialized) or is in the key: the current
    device and whether each tensor's address is a multiple of 16. The direct call passes what `JITFunction.run`
    passes at its end (Triton 3.6 and 3.9 alike): every parameter positionally in signature order, constexprs
    included, on the current device's current stream; no launch metadata and no hooks, as none is set (else the JIT
    path). It skips the JIT's check that the kernel's globals are unchanged: `_rope_kernel` reads none."""
    if not plan.grid[0]:
        return  # no tokens
    # Plain attributes, cheap to read per call (Triton reads TRITON_DEBUG and TRITON_INSTRUMENTATION_MODE into them
    # at import, not per call).
    runtime = knobs.runtime
    jit_only = (
        RUNS_IN_INTERPRETER  # the interpreter returns no CompiledKernel and runs on CPU tensors
        or _hooked(runtime.launch_enter_hook)
        or _hooked(runtime.launch_exit_hook)
        or _rope_kernel.pre_run_hooks
        # Knobs the JIT folds into its own cache key (compile options, custom pass pipelines): debugging tools that
        # may be switched on mid-run, so while they are on every launch goes through the JIT.
        or runtime.debug
        or knobs.compilation.instrumentation_mode
        or runtime.add_stages_inspection_hook is not None
    )
    if not jit_only:
        device = driver.active.get_current_device()
        key = (
            device, q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0, q_out.data_ptr() % 16 == 0,
            k_out.data_ptr() % 16 == 0, positions.data_ptr() % 16 == 0, inv_freq.data_ptr() % 16 == 0,
        )  # fmt: skip
        kernel = plan.kernels.get(key)
        if kernel is not None:
            kernel.run(
                plan.grid[0], 1, 1, driver.active.get_current_stream(device), kernel.function, kernel.packed_metadata,
                None, None, None, q, k, q_out, k_out, positions, inv_freq, *plan.scalars, scaling,
                *plan.constexprs.values(),
            )  # fmt: skip
            return
    kernel = _rope_kernel[plan.grid](
        q, k, q_out, k_out, positions, inv_freq, *plan.scalars, scaling, **plan.constexprs, num_warps=plan.num_warps
    )
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
    tile: int | None = None,
) -> None:
    """Rotate q, k into q_out, k_out (new tensors: lanes [R, D) are copied).

    q, q_out: (T, Hq, D) or (B, S, Hq, D); k, k_out: same leading dims, Hk heads; any strides with
    stride(-1) == 1; one dtype. positions: integer, text (3, T) / (3, B, S), vision (T, 2) [row, col]; any strides.
    inv_freq: fp32 contiguous, (R/2,) for text, (R/4,) for vision; R <= D. sections: the three mRoPE sections as a
    tuple (ignored for vision). No validation here: `mrope_kernels.ops` does it.
    block_t / num_warps / tile (TILE_HALVES, TILE_ROWS, TILE_SPLIT) override the heuristics (benchmark sweeps only).
    """
    plan = launch_plan(
        q.shape, q.stride(), k.shape, k.stride(), q_out.stride(), k_out.stride(), positions.stride(),
        (q.dtype, k.dtype, q_out.dtype, k_out.dtype, positions.dtype, inv_freq.dtype), inv_freq.shape[0], layout,
        sections, conjugate, block_t, num_warps, tile,
    )  # fmt: skip
    launch(plan, q, k, q_out, k_out, positions, inv_freq, float(scaling))
