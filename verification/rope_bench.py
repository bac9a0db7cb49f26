"""Benchmark the fused rotary kernels against HF eager, torch.compile, Liger-Kernel and the copy floor (GPU).

Five cases (Qwen2.5-VL-7B, Qwen3-VL-8B and Qwen3.5 text; the Qwen2.5-VL and Qwen3-VL ViTs) at T = 16384 packed
tokens, bf16, in one process, timed with `triton.testing.do_bench` medians (warmup 25 ms, rep 100 ms; it flushes L2
between repetitions). HF and Liger receive cos/sin precomputed (their build cost is excluded; ours includes sin/cos
for text, and for vision receives the cos/sin table the patched tower builds once per forward for all its
blocks, as transformers' tower builds its cos/sin); inputs are HF's layout, q = randn(1, T, H, D).transpose(1, 2)
for text; the copy floor clones q and k once (fwd) and twice (fwd+bwd). One deviation, applied to every
implementation alike: fwd+bwd returns gradients with `torch.autograd.grad` instead of accumulating into `.grad`, so
no accumulation kernel is timed.

Rows per case:
- ours_as_trained: what a patched model's attention calls (the patch's dispatcher in place of transformers'
  apply function, then `apply_mrope` / `apply_vision_rope_table` and the autograd.Function), fwd+bwd through
  autograd;
- ours_kernels_only: the same forward and backward kernels launched back to back without autograd;
- hf_eager, torch_compile (of HF's apply, fullgraph), liger, copy_floor; every row also as × the floor;
- copy_floor_function: the floor's copies as a Python autograd.Function through the engine (the stack's `CopyFloor`
  called once): the host cost any such op pays per call, beside ours;
- mechanism_autograd_function / mechanism_triton_op: the same launches through the product's autograd.Function or
  through a torch.library.triton_op with registered autograd, bare (no validation, no dispatcher): which is lighter.
Layer-stack rows, `<impl>_stack` for ours_as_trained, hf_eager, torch_compile, liger and copy_floor: the rows above
start the autograd engine (on CUDA also its device thread) once per rope call, where a training step runs one
backward over all layers, so they measure the engine as much as the op. A stack chains --stack N calls, call i + 1
rotating call i's outputs as N decoder layers each rotate their own q and k, then takes one `torch.autograd.grad`
over the last outputs w.r.t. the first inputs; fwd and fwd+bwd are the chain's time / N, µs per call. The floor's
stack chains N identities that clone q and k in forward and clone their gradients in backward (per call the copy
floor's bytes); stack rows' × floor is against it.
Host µs per call at T = 1 (GPU work of a few µs, so what is measured is the host's Python, dispatch and launch):
wall clock of --host-calls back-to-back calls with one synchronize at the end, for ours, the two mechanisms and
Liger; and for the kernel launch alone into preallocated outputs (fwd+bwd: the forward and the conjugate launch),
`launch_jit`, `rope_launch` as it was before its direct launch (plan lookup, then Triton's JIT), and `launch_direct`,
`rope_launch` (plan lookup, then the kept compiled kernel's direct launch); and per call of --stack chained calls
with one backward (`<impl>_stack`) for ours, Liger and the copy floor's Function (the least a Python
autograd.Function node costs): the engine's start shared by the stack, as in a training step.
Device µs (`fwdbwd_device_us`, torch.profiler's sum of kernel durations, no L2 flush) beside the wall-clock fwd+bwd
of ours per call and of every stack: where the wall time is well above it, the host bounds the row.

    python -m scripts.bench_mrope --out artifacts/bench/bench_mrope.json [--tokens 16384] [--stack 8] [--sweep]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch
from triton.testing import do_bench

from mrope_kernels import ops, patch, triton_rope
from verification.provenance import provenance


@dataclass(frozen=True)
class Case:
    name: str
    heads_q: int
    heads_k: int
    head_dim: int
    rotary_dim: int
    sections: tuple[int, int, int] | None  # None: vision 2-D rope
    interleaved: bool = False


CASES = [
    Case("qwen2.5-vl-7b text 28/4x128 chunked", 28, 4, 128, 128, (16, 24, 24)),
    Case("qwen3-vl-8b text 32/8x128 interleaved", 32, 8, 128, 128, (24, 20, 20), True),
    Case("qwen3.5 text 24/4x256 rot64 interleaved", 24, 4, 256, 64, (11, 11, 10), True),
    Case("qwen2.5-vl vit 16x80 2d", 16, 16, 80, 80, None),
    Case("qwen3-vl/3.5 vit 16x72 2d", 16, 16, 72, 72, None),
]

# The implementations with an autograd path, timed also as a stack of layers (beside the copy floor's stack).
STACKED = ("ours_as_trained", "hf_eager", "torch_compile", "liger")


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def device_ms(fn, calls: int = 10) -> float:
    """Device time of `fn`'s GPU work per call in ms (torch.profiler: the sum of its kernels' durations), beside its
    wall-clock time: a row whose wall time is well above it waits on the host. No L2 flush between calls."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(event.self_device_time_total for event in prof.key_averages()) / calls / 1e3


def hf_cos_sin(case: Case, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin exactly as transformers' rotary modules build them (text: cast to the activation dtype)."""
    if case.sections is None:
        freqs = (positions[..., None].float() * inv_freq).flatten(1)  # (T, D/2)
        emb = torch.cat((freqs, freqs), -1)
        return emb.cos(), emb.sin()
    freqs = positions[..., None].float() * inv_freq  # (3, 1, T, R/2)
    if case.interleaved:
        thw = freqs[0].clone()
        for dim, offset in enumerate((1, 2), start=1):
            idx = slice(offset, case.sections[dim] * 3, 3)
            thw[..., idx] = freqs[dim, ..., idx]
    else:
        thw = torch.cat([m[i % 3] for i, m in enumerate(freqs.split(list(case.sections), dim=-1))], dim=-1)
    emb = torch.cat((thw, thw), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def fwd_and_fwdbwd(fn, inputs: tuple[torch.Tensor, torch.Tensor], grads) -> tuple[float, float]:
    """(fwd, fwd+bwd) in ms; fwd+bwd through the autograd engine."""
    with torch.no_grad():
        t_fwd = bench_ms(lambda: fn(*inputs))

    def fwd_bwd():
        outs = fn(*inputs)
        torch.autograd.grad(outs, inputs, grads)

    return t_fwd, bench_ms(fwd_bwd)


def stacked(fn, layers: int):
    """`fn(q, k) -> (q, k)` chained `layers` times, each call rotating the previous call's outputs, as the decoder
    layers of a model each rotate their own q and k; one backward through the result spans every call."""

    def stack(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for _ in range(layers):
            q, k = fn(q, k)
        return q, k

    return stack


class CopyFloor(torch.autograd.Function):
    """Identity on (q, k) that clones both in forward and both gradients in backward: the copy floor's bytes per
    call, chainable like a rope call (a bare `clone` would pass its gradient through without a copy)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q.clone(), k.clone()

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad_q.clone(), grad_k.clone()


def _timed(label: str, fn, inputs: tuple[torch.Tensor, torch.Tensor], grads) -> tuple[float, float]:
    """`fwd_and_fwdbwd`, where a failing (third-party) implementation is a NaN row and a message, not a crash."""
    try:
        return fwd_and_fwdbwd(fn, inputs, grads)
    except Exception as exc:
        print(f"{label} FAILED: {exc!r}"[:400], file=sys.stderr)
        return math.nan, math.nan


def _device_fwdbwd_us(label: str, fn, inputs: tuple[torch.Tensor, torch.Tensor], grads) -> float:
    """fwd+bwd device µs per call of `fn` (`device_ms`); NaN and a message where it fails."""
    try:
        return device_ms(lambda: torch.autograd.grad(fn(*inputs), inputs, grads)) * 1e3
    except Exception as exc:
        print(f"{label} device timing FAILED: {exc!r}"[:400], file=sys.stderr)
        return math.nan


def make_inputs(case: Case, n_tokens: int, dev: str = "cuda") -> dict:
    """HF-layout inputs of one case (q = randn(1, T, H, D).transpose(1, 2) for text), HF's cos/sin, gradients."""
    dtype = torch.bfloat16
    if case.sections is None:
        q = torch.randn(n_tokens, case.heads_q, case.head_dim, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(n_tokens, case.heads_k, case.head_dim, device=dev, dtype=dtype, requires_grad=True)
        positions = torch.randint(0, 64, (n_tokens, 2), device=dev)
        half = case.head_dim // 2
        inv_freq = 1.0 / (10000 ** (torch.arange(0, half, 2, device=dev, dtype=torch.float) / half))
    else:
        q = torch.randn(1, n_tokens, case.heads_q, case.head_dim, device=dev, dtype=dtype).transpose(1, 2)
        k = torch.randn(1, n_tokens, case.heads_k, case.head_dim, device=dev, dtype=dtype).transpose(1, 2)
        q.requires_grad_()
        k.requires_grad_()
        positions = torch.randint(0, 4096, (3, 1, n_tokens), device=dev)
        rot = case.rotary_dim
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, rot, 2, device=dev, dtype=torch.float) / rot))
    cos, sin = hf_cos_sin(case, positions, inv_freq, dtype)
    grads = (torch.randn_like(q), torch.randn_like(k))
    # What our kernels read the angles from: text positions and inv_freq, the vision cos/sin table.
    angles = (ops.vision_rope_table(positions, inv_freq),) if case.sections is None else (positions, inv_freq)
    return dict(q=q, k=k, positions=positions, inv_freq=inv_freq, angles=angles, cos=cos, sin=sin, grads=grads)


def implementations(case: Case, x: dict, with_compile: bool) -> dict:
    """name -> (fn(q, k), (q, k), grads). Every entry takes HF's inputs and returns HF's layout, except
    ours_kernels_only (see _kernels_only)."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf_qwen25
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen35

    vision = case.sections is None
    cos, sin, inputs, grads = x["cos"], x["sin"], (x["q"], x["k"]), x["grads"]
    if vision:
        hf_apply = hf_qwen25.apply_rotary_pos_emb_vision
        # What a patched model's vision attention calls: the dispatcher in the module global's place.
        as_trained = patch._make_vision_apply(hf_apply)
        rope_args = patch.VisionRopeArgs(*x["angles"])
        ours = lambda q_, k_: as_trained(q_, k_, x["positions"], rope_args)
    else:
        hf_apply = hf_qwen35.apply_rotary_pos_emb if case.rotary_dim < case.head_dim else hf_qwen25.apply_rotary_pos_emb
        as_trained = patch._make_text_apply(hf_apply)
        rope_args = patch.MRopeArgs(x["inv_freq"], case.sections, case.interleaved, 1.0)
        ours = lambda q_, k_: as_trained(q_, k_, x["positions"], rope_args)
    impls = {
        "ours_as_trained": (ours, inputs, grads),
        "hf_eager": (lambda q_, k_: hf_apply(q_, k_, cos, sin), inputs, grads),
    }
    if with_compile:
        # One code object serves every case: without a reset its recompiles add up to dynamo's limit (8) and
        # fullgraph turns the fifth case into a failure.
        torch._dynamo.reset()
        compiled = torch.compile(lambda q_, k_: hf_apply(q_, k_, cos, sin), fullgraph=True, dynamic=False)
        impls["torch_compile"] = (compiled, inputs, grads)
    liger = _liger(vision)
    if liger is not None:
        impls["liger"] = (lambda q_, k_: liger(q_, k_, cos, sin), inputs, grads)
    # The two autograd mechanisms a fused op can use, bare (no validation, no patch dispatcher), on the kernel's views:
    # the autograd.Function the product uses, and a torch.library.triton_op with registered autograd.
    layout, sections = layout_of(case), tuple(case.sections or (0, 0, 0))
    to_kernel = (lambda t: t) if vision else (lambda t: t.transpose(1, 2))
    # The product's Function takes the `_Rope` of its calls' signature (one for all calls of a row), found once here.
    kernel_rope = ops._rope(to_kernel(x["q"]), to_kernel(x["k"]), x["angles"], layout, sections, 1.0, False)
    function = lambda q_, k_, angles, *_: ops._RopeFunction.apply(q_, k_, *(*angles, None)[:2], kernel_rope)
    for name, rope in (("mechanism_autograd_function", function), ("mechanism_triton_op", triton_op_rope())):
        impls[name] = (
            lambda q_, k_, rope=rope: tuple(
                to_kernel(t) for t in rope(to_kernel(q_), to_kernel(k_), x["angles"], layout, sections, 1.0)
            ),
            inputs,
            grads,
        )
    return impls


def _plan(q, k, q_out, k_out, angles, layout: int, sections, conjugate: bool, **overrides) -> triton_rope.LaunchPlan:
    """The product's launch plan for these tensors (rows of text, heads of vision, any strides)."""
    dtypes = tuple(t.dtype for t in (q, k, q_out, k_out, *angles))
    shapes = (q.shape, q.stride(), k.shape, k.stride(), q_out.stride(), k_out.stride())
    if layout == triton_rope.LAYOUT_VISION:
        return triton_rope.vision_launch_plan(*shapes, dtypes, conjugate, **overrides)
    positions, inv_freq = angles
    return triton_rope.launch_plan(
        *shapes, positions.stride(), dtypes, inv_freq.shape[0], layout, tuple(sections), 1.0, conjugate, **overrides
    )


@functools.cache  # one registration per process
def triton_op_rope():
    """`bench_mrope::rope` as a `torch.library.triton_op` (kernel via `wrap_triton`) with its backward registered,
    called with the static args (layout, sections, scaling) after the tensors: the alternative to the product's
    autograd.Function, for the host-cost comparison only."""
    from torch.library import register_autograd, triton_op, wrap_triton

    @triton_op("bench_mrope::rope", mutates_args=())
    def rope(
        q: torch.Tensor,
        k: torch.Tensor,
        angles: list[torch.Tensor],
        layout: int,
        sections: list[int],
        scaling: float,
        conjugate: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        plan = _plan(q, k, q_out, k_out, angles, layout, sections, conjugate)
        wrap_triton(plan.kernel)[plan.grid](
            q, k, q_out, k_out, *angles, *plan.scalars, **plan.constexprs, num_warps=plan.num_warps
        )
        return q_out, k_out

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[2])
        ctx.static_args = inputs[3:6]

    def backward(ctx, grad_q, grad_k):
        grads = rope(grad_q.contiguous(), grad_k.contiguous(), list(ctx.saved_tensors), *ctx.static_args, True)
        return *grads, [None] * len(ctx.saved_tensors), None, None, None, None

    register_autograd("bench_mrope::rope", backward, setup_context=setup_context)
    return lambda q, k, angles, layout, sections, scaling: rope(q, k, list(angles), layout, list(sections), scaling,
                                                                 False)  # fmt: skip


def _kernels_only(case: Case, x: dict):
    """(fwd, fwd+bwd) callables of the device work of ours without autograd: exactly what `_RopeFunction` runs
    (allocate outputs, one launch per pass; backward = conjugate), on the HF-layout tensors the dispatcher hands
    over (text: heads first)."""
    layout, sections = layout_of(case), tuple(case.sections or (0, 0, 0))
    q, k = x["q"].detach(), x["k"].detach()
    grad_q, grad_k = (g.detach() for g in x["grads"])
    angles = x["angles"]
    rope = ops._rope(q, k, angles, layout, sections, 1.0, case.sections is not None)
    fwd = lambda: ops._rotated(q, k, angles, rope, False)
    bwd = lambda: ops._rotated(grad_q, grad_k, angles, rope, True)
    return fwd, lambda: (fwd(), bwd())


def run_case(case: Case, n_tokens: int, layers: int, rows: list[dict], sweep: bool) -> None:
    x = make_inputs(case, n_tokens)
    q, k = x["q"], x["k"]
    moved_bytes = 2 * (q.numel() + k.numel()) * q.element_size()  # read + write q, k once
    impls = implementations(case, x, with_compile=True)
    for impl, (fn, inputs, impl_grads) in impls.items():
        t_fwd, t_fb = _timed(f"{case.name} {impl}", fn, inputs, impl_grads)
        rows.append(_row(case.name, impl, t_fwd, t_fb, moved_bytes))
        if impl == "ours_as_trained":
            rows[-1]["fwdbwd_device_us"] = _device_fwdbwd_us(f"{case.name} {impl}", fn, inputs, impl_grads)
    # The copy floor's bytes through a Python autograd.Function and the engine, per call: what any such op pays.
    t_fwd, t_fb = _timed(f"{case.name} copy_floor_function", CopyFloor.apply, (q, k), x["grads"])
    rows.append(_row(case.name, "copy_floor_function", t_fwd, t_fb, moved_bytes))
    rows[-1]["fwdbwd_device_us"] = _device_fwdbwd_us(f"{case.name} copy_floor_function", CopyFloor.apply, (q, k),
                                                     x["grads"])  # fmt: skip
    fwd, fwd_bwd = _kernels_only(case, x)
    rows.append(_row(case.name, "ours_kernels_only", bench_ms(fwd), bench_ms(fwd_bwd), moved_bytes))
    with torch.no_grad():
        q_dense, k_dense = q.detach().contiguous(), k.detach().contiguous()
        t_copy = bench_ms(lambda: (q_dense.clone(), k_dense.clone()))
    rows.append(_row(case.name, "copy_floor", t_copy, 2 * t_copy, moved_bytes))
    # After the per-call rows and before the next case's dynamo reset: the stacks' compiled calls (grad mode off and
    # on, the outputs' strides as inputs) add a few recompiles to this case's, well under dynamo's limit.
    stacks = {impl: impls[impl] for impl in STACKED if impl in impls}
    stacks["copy_floor"] = (CopyFloor.apply, (q, k), x["grads"])
    for impl, (fn, inputs, impl_grads) in stacks.items():
        t_fwd, t_fb = _timed(f"{case.name} {impl}_stack", stacked(fn, layers), inputs, impl_grads)
        rows.append({**_row(case.name, f"{impl}_stack", t_fwd / layers, t_fb / layers, moved_bytes), "layers": layers})
        device_us = _device_fwdbwd_us(f"{case.name} {impl}_stack", stacked(fn, layers), inputs, impl_grads)
        rows[-1]["fwdbwd_device_us"] = device_us / layers
    if sweep:
        _sweep(case, x, rows)


def host_us_per_call(case: Case, calls: int, layers: int) -> list[dict]:
    """Host µs per call at T = 1, where the GPU work is a few µs: wall clock of `calls` back-to-back calls with one
    synchronize at the end, so the host's Python, dispatch and launch cost is what is measured; `<impl>_stack` rows
    per call of `layers` chained calls with one backward."""
    x = make_inputs(case, 1)
    impls = {name: entry for name, entry in implementations(case, x, with_compile=False).items() if name != "hf_eager"}
    fwd, fwd_bwd = _kernels_only(case, x)
    out = [_host_row(case.name, impl, *_autograd_calls(fn, inputs, grads), calls) for impl, (fn, inputs, grads) in
           impls.items()]  # fmt: skip
    out.append(_host_row(case.name, "ours_kernels_only", fwd, fwd_bwd, calls))
    for impl, (launch_fwd, launch_fwd_bwd) in launches(case, x).items():
        out.append(_host_row(case.name, impl, launch_fwd, launch_fwd_bwd, calls))
    # Stacks: one engine start per `layers` calls, as in a training step; the copy floor's Function is the least a
    # Python autograd.Function node costs.
    stacks = {impl: impls[impl] for impl in ("ours_as_trained", "liger") if impl in impls}
    stacks["copy_floor"] = (CopyFloor.apply, (x["q"], x["k"]), x["grads"])
    for impl, (fn, inputs, grads) in stacks.items():
        row = _host_row(
            case.name, f"{impl}_stack", *_autograd_calls(stacked(fn, layers), inputs, grads), max(1, calls // layers)
        )
        out.append({**row, "host_fwd_us": row["host_fwd_us"] / layers, "host_fwdbwd_us": row["host_fwdbwd_us"] / layers,
                    "layers": layers})  # fmt: skip
    return out


def _autograd_calls(fn, inputs: tuple[torch.Tensor, torch.Tensor], grads):
    """(fwd without grad, fwd + `torch.autograd.grad`) callables of `fn` on `inputs`."""

    def run_fwd():
        with torch.no_grad():
            fn(*inputs)

    def run_fwd_bwd():
        torch.autograd.grad(fn(*inputs), inputs, grads)

    return run_fwd, run_fwd_bwd


def launches(case: Case, x: dict) -> dict:
    """name -> (fwd, fwd+bwd) callables of the kernel launch alone on the kernel's views of `x`, writing preallocated
    outputs, which they return (fwd+bwd: the forward's, then the conjugate launch's): `launch_jit` is `rope_launch` as
    it was before its direct launch (every launch through Triton's JIT), `launch_direct` is `rope_launch`."""
    layout, sections = layout_of(case), tuple(case.sections or (0, 0, 0))
    q, k = x["q"].detach(), x["k"].detach()
    if case.sections is not None:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    tensors = (q, k, torch.empty_like(q), torch.empty_like(k), *x["angles"])

    def jit(conjugate: bool):
        plan = _plan(*tensors[:4], tensors[4:], layout, sections, conjugate)
        plan.kernel[plan.grid](*tensors, *plan.scalars, **plan.constexprs, num_warps=plan.num_warps)
        return tensors[2:4]

    def direct(conjugate: bool):
        if layout == triton_rope.LAYOUT_VISION:
            triton_rope.vision_rope_launch(*tensors, conjugate)
        else:
            triton_rope.rope_launch(*tensors, layout, sections, 1.0, conjugate)
        return tensors[2:4]

    return {
        name: (lambda launch=launch: launch(False), lambda launch=launch: (launch(False), launch(True)))
        for name, launch in (("launch_jit", jit), ("launch_direct", direct))
    }


def _host_row(case: str, impl: str, fwd, fwd_bwd, calls: int) -> dict:
    row = {"case": case, "impl": impl, "tokens": 1, "calls": calls}
    for key, fn in (("host_fwd_us", fwd), ("host_fwdbwd_us", fwd_bwd)):
        try:
            for _ in range(20):  # warm: compilation, caches, allocator
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            row[key] = (time.perf_counter() - start) / calls * 1e6
        except Exception as exc:
            print(f"{case} {impl} host timing FAILED: {exc!r}"[:400], file=sys.stderr)
            row[key] = math.nan
    return row


def layout_of(case: Case) -> int:
    if case.sections is None:
        return triton_rope.LAYOUT_VISION
    return triton_rope.LAYOUT_INTERLEAVED if case.interleaved else triton_rope.LAYOUT_CHUNKED


def _sweep(case: Case, x: dict, rows: list[dict]) -> None:
    """Forward time of launcher variants, to tune the heuristics; the default is the row marked `default`: text
    tokens per program (BLOCK_T) x num_warps; vision tokens per program (tiles of BLOCK_T x the row chunk) x
    num_warps."""
    layout, sections = layout_of(case), tuple(case.sections or (0, 0, 0))
    q, k = x["q"].detach(), x["k"].detach()
    if case.sections is not None:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if layout == triton_rope.LAYOUT_VISION:
        configs = [(bt, w) for bt in (4, 8, 16, 32) for w in (2, 4, 8)]
        launch = lambda bt, w: triton_rope.vision_rope_launch(q, k, qo, ko, *x["angles"], False, bt, w)
    else:
        configs = [(1, 2), (2, 2), (1, 4), (2, 4), (1, 8), (2, 8)]
        launch = lambda bt, w: triton_rope.rope_launch(q, k, qo, ko, *x["angles"], layout, sections, 1.0, False, bt, w)
    for block_t, warps in [(None, None), *configs]:
        t = bench_ms(lambda bt=block_t, w=warps: launch(bt, w))
        name = "default" if block_t is None else f"bt{block_t}_w{warps}"
        rows.append({"case": case.name, "impl": f"sweep_{name}", "fwd_us": t * 1e3})


@functools.cache  # import (or report its absence) once
def _liger(vision: bool):
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb, liger_rotary_pos_emb_vision
    except ImportError as exc:
        print(f"Liger-Kernel not importable, skipped: {exc}", file=sys.stderr)
        return None
    return liger_rotary_pos_emb_vision if vision else liger_rotary_pos_emb


def _row(case: str, impl: str, t_fwd_ms: float, t_fb_ms: float, moved_bytes: int) -> dict:
    return {
        "case": case,
        "impl": impl,
        "fwd_us": t_fwd_ms * 1e3,
        "fwdbwd_us": t_fb_ms * 1e3,
        "fwd_tbps": moved_bytes / (t_fwd_ms * 1e-3) / 1e12,
        "fwdbwd_tbps": 2 * moved_bytes / (t_fb_ms * 1e-3) / 1e12,
    }


def with_floor_ratios(rows: list[dict]) -> None:
    """Add fwd_x_floor / fwdbwd_x_floor to every timed row: its time over the copy floor of the same case, a stack
    row's (one with `layers`) over the copy floor's stack."""
    floors = {(r["case"], "layers" in r): r for r in rows if r["impl"] in ("copy_floor", "copy_floor_stack")}
    for r in rows:
        if "fwdbwd_us" in r:
            floor = floors[r["case"], "layers" in r]
            r["fwd_x_floor"] = r["fwd_us"] / floor["fwd_us"]
            r["fwdbwd_x_floor"] = r["fwdbwd_us"] / floor["fwdbwd_us"]


def check_targets(rows: list[dict]) -> list[dict]:
    """The kernels' targets per case: as trained fwd+bwd <= 1.3x the floor and faster than Liger and
    torch.compile, per call and in the layer stack; the kernels <= 1.15x the floor. Missing or failed rows count as
    misses."""
    checks = []
    for case in dict.fromkeys(r["case"] for r in rows if "fwdbwd_us" in r):
        by_impl = {r["impl"]: r for r in rows if r["case"] == case and "fwdbwd_us" in r}
        goals = {
            "as_trained_fwdbwd_le_1.3x_floor": by_impl["ours_as_trained"]["fwdbwd_x_floor"] <= 1.3,
            "kernels_fwdbwd_le_1.15x_floor": by_impl["ours_kernels_only"]["fwdbwd_x_floor"] <= 1.15,
            "as_trained_stack_fwdbwd_le_1.3x_floor": by_impl["ours_as_trained_stack"]["fwdbwd_x_floor"] <= 1.3,
        }
        for rival in ("liger", "torch_compile"):
            goals[f"as_trained_faster_than_{rival}"] = _faster(by_impl, "ours_as_trained", rival)
            goals[f"as_trained_stack_faster_than_{rival}"] = _faster(by_impl, "ours_as_trained_stack", f"{rival}_stack")
        checks.append({"case": case, **goals})
    return checks


def _faster(by_impl: dict[str, dict], impl: str, rival: str) -> bool:
    """`impl`'s fwd+bwd beats `rival`'s; False when the rival has no row (NaN, a failed row, is never faster)."""
    return rival in by_impl and by_impl[impl]["fwdbwd_us"] < by_impl[rival]["fwdbwd_us"]


def print_tables(rows: list[dict], host_rows: list[dict], checks: list[dict]) -> None:
    timed = [r for r in rows if "fwdbwd_us" in r]
    stack = [r for r in timed if "layers" in r]
    _print_timed([r for r in timed if "layers" not in r])
    print(f"\nlayer stack: {stack[0]['layers']} chained calls, one backward; µs per call")
    _print_timed(stack)
    print(f"\nhost µs per call at T = 1\n{'case':42s} {'impl':28s} {'fwd':>8s} {'fwd+bwd':>8s}")
    for r in host_rows:
        print(f"{r['case']:42s} {r['impl']:28s} {r['host_fwd_us']:8.1f} {r['host_fwdbwd_us']:8.1f}")
    print("\ntargets:")
    for c in checks:
        misses = [goal for goal, met in c.items() if goal != "case" and not met]
        print(f"  {c['case']:42s} {'all met' if not misses else 'MISSED: ' + ', '.join(misses)}")
    sweep = [r for r in rows if r["impl"].startswith("sweep")]
    if sweep:
        print("\nlaunch-config sweep (kernel fwd µs):")
        for r in sweep:
            print(f"  {r['case']:42s} {r['impl']:28s} {r['fwd_us']:8.1f}")


def _print_timed(rows: list[dict]) -> None:
    """The timed rows; `device µs` (fwd+bwd on the GPU, profiled) where measured: far below fwd+bwd, the host bounds
    the row."""
    header = ("fwd µs", 8), ("×floor", 7), ("fwd+bwd µs", 11), ("×floor", 7), ("device µs", 9)
    print(f"{'case':42s} {'impl':28s} " + " ".join(f"{name:>{width}s}" for name, width in header))
    for r in rows:
        device = f"{r['fwdbwd_device_us']:9.1f}" if "fwdbwd_device_us" in r else ""
        print(
            f"{r['case']:42s} {r['impl']:28s} {r['fwd_us']:8.1f} {r['fwd_x_floor']:7.2f} "
            f"{r['fwdbwd_us']:11.1f} {r['fwdbwd_x_floor']:7.2f} {device}"
        )


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = [r for r in rows if "fwdbwd_us" in r]
    cases = list(dict.fromkeys(r["case"] for r in table))
    impls = list(dict.fromkeys(r["impl"] for r in table))
    fig, ax = plt.subplots(figsize=(14, 5))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        values = [next((r["fwdbwd_us"] for r in table if r["case"] == c and r["impl"] == impl), 0.0) for c in cases]
        ax.bar([x + i * width for x in range(len(cases))], values, width, label=impl)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))], [c[:28] for c in cases], fontsize=7)
    ax.set_ylabel("fwd+bwd µs (lower is better)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="artifacts/bench/bench_mrope.json", help="JSON path (a .png lands beside)")
    parser.add_argument("--tokens", type=int, default=16384, help="packed tokens T")
    parser.add_argument("--stack", type=int, default=8, help="rope calls chained per layer-stack row (decoder layers)")
    parser.add_argument("--host-calls", type=int, default=2000, help="calls per host timing at T = 1")
    parser.add_argument("--sweep", action="store_true", help="also time launch-config variants of our kernel")
    args = parser.parse_args()
    if args.stack < 1:
        parser.error("--stack must be at least 1")
    if not torch.cuda.is_available():
        sys.exit("bench_mrope needs a CUDA GPU")
    torch.manual_seed(0)
    rows: list[dict] = []
    host_rows: list[dict] = []
    for case in CASES:
        run_case(case, args.tokens, args.stack, rows, args.sweep)
        host_rows += host_us_per_call(case, args.host_calls, args.stack)
    with_floor_ratios(rows)
    checks = check_targets(rows)
    meta = {
        "provenance": provenance(),
        "tokens": args.tokens,
        "stack": args.stack,
        "dtype": "bfloat16",
        "host_calls": args.host_calls,
    }
    print(" ".join(f"{k}={v}" for k, v in meta.items()))
    print_tables(rows, host_rows, checks)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "host_rows": host_rows, "targets": checks}, f, indent=1)
    print(f"wrote {args.out}")
    plot(rows, os.path.splitext(args.out)[0] + ".png")
