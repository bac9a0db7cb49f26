"""Benchmark the fused rotary kernels against HF eager, torch.compile, Liger-Kernel and the copy floor (GPU).

The five cases of ANCHORS.md at T = 16384 packed tokens, bf16, in one process, timed with
`triton.testing.do_bench` medians (warmup 25 ms, rep 100 ms; it flushes L2 between repetitions).
Method as the anchors: HF and Liger receive cos/sin precomputed (their build cost is excluded, ours includes
sin/cos); inputs are HF's layout, q = randn(1, T, H, D).transpose(1, 2); the copy floor clones q and k once
(fwd) and twice (fwd+bwd). One deviation, applied to every implementation alike: fwd+bwd returns gradients with
`torch.autograd.grad` instead of accumulating into `.grad`, so no accumulation kernel is timed.
Plus the in-place Qwen3.5 row: forward in place on q, k (only the 64 rotary lanes move) against the floor of copying
those lanes, and fwd+bwd with the backward autograd runs (the gradients rotated into new tensors, never in place:
they may be shared) against that lane copy plus one full-width copy of the gradients.

    python scripts/bench_mrope.py --out artifacts/bench [--tokens 16384] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from datetime import UTC, datetime

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mrope_kernels import apply_mrope, apply_vision_rope, triton_rope
from mrope_kernels.ops import _rotated


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


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


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


def run_case(case: Case, n_tokens: int, rows: list[dict], sweep: bool) -> None:
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf_qwen25
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen35

    dev, dtype = "cuda", torch.bfloat16
    vision = case.sections is None
    if vision:
        q = torch.randn(n_tokens, case.heads_q, case.head_dim, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(n_tokens, case.heads_k, case.head_dim, device=dev, dtype=dtype, requires_grad=True)
        positions = torch.randint(0, 64, (n_tokens, 2), device=dev)
        half = case.head_dim // 2
        inv_freq = 1.0 / (10000 ** (torch.arange(0, half, 2, device=dev, dtype=torch.float) / half))
        ours_q, ours_k = q, k
        hf_apply = hf_qwen25.apply_rotary_pos_emb_vision
        ours = lambda q_, k_: apply_vision_rope(q_, k_, positions, inv_freq)
    else:
        q = torch.randn(1, n_tokens, case.heads_q, case.head_dim, device=dev, dtype=dtype).transpose(1, 2)
        k = torch.randn(1, n_tokens, case.heads_k, case.head_dim, device=dev, dtype=dtype).transpose(1, 2)
        q.requires_grad_()
        k.requires_grad_()
        positions = torch.randint(0, 4096, (3, 1, n_tokens), device=dev)
        rot = case.rotary_dim
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, rot, 2, device=dev, dtype=torch.float) / rot))
        hf_apply = hf_qwen35.apply_rotary_pos_emb if rot < case.head_dim else hf_qwen25.apply_rotary_pos_emb
        # Ours takes the packed (T, H, D) layout: the same storage as HF's (1, H, T, D) view, no copy.
        ours_q, ours_k = q.transpose(1, 2)[0], k.transpose(1, 2)[0]
        packed_positions = positions[:, 0]

        def ours(q_, k_):
            return apply_mrope(q_, k_, packed_positions, inv_freq, case.sections, case.interleaved)

    cos, sin = hf_cos_sin(case, positions, inv_freq, dtype)
    grads = (torch.randn_like(q), torch.randn_like(k))
    moved_bytes = 2 * (q.numel() + k.numel()) * q.element_size()  # read + write q, k once

    impls = {
        "ours": (ours, (ours_q, ours_k), tuple(g.transpose(1, 2)[0] for g in grads) if not vision else grads),
        "hf_eager": (lambda q_, k_: hf_apply(q_, k_, cos, sin), (q, k), grads),
        "torch_compile": (torch.compile(lambda q_, k_: hf_apply(q_, k_, cos, sin), fullgraph=True), (q, k), grads),
    }
    liger = _liger(vision)
    if liger is not None:
        impls["liger"] = (lambda q_, k_: liger(q_, k_, cos, sin), (q, k), grads)
    for impl, (fn, inputs, impl_grads) in impls.items():
        try:
            t_fwd, t_fb = fwd_and_fwdbwd(fn, inputs, impl_grads)
        except Exception as exc:  # a third-party implementation failing is a row, not a crash
            print(f"{case.name} {impl} FAILED: {exc!r}"[:400], file=sys.stderr)
            t_fwd = t_fb = math.nan
        rows.append(_row(case.name, impl, t_fwd, t_fb, moved_bytes))
    kernel_positions = positions if vision else packed_positions
    rows.append(_kernels_only_row(case, ours_q, ours_k, kernel_positions, inv_freq, moved_bytes))
    with torch.no_grad():
        q_dense, k_dense = q.detach().contiguous(), k.detach().contiguous()
        t_copy = bench_ms(lambda: (q_dense.clone(), k_dense.clone()))
    rows.append(_row(case.name, "copy_floor", t_copy, 2 * t_copy, moved_bytes))

    if not vision and case.rotary_dim < case.head_dim:
        _inplace_rows(case, ours_q, ours_k, packed_positions, inv_freq, rows)
    if sweep:
        _sweep(case, ours_q, ours_k, kernel_positions, inv_freq, rows)


def _layout(case: Case) -> int:
    if case.sections is None:
        return triton_rope.LAYOUT_VISION
    return triton_rope.LAYOUT_INTERLEAVED if case.interleaved else triton_rope.LAYOUT_CHUNKED


def _kernels_only_row(case: Case, q, k, positions, inv_freq, moved_bytes: int) -> dict:
    """The device work of our fwd+bwd without the autograd engine's host round trip: exactly what
    `_RopeFunction.forward` and `.backward` run (allocate outputs, one launch each; backward = conjugate)."""
    layout, sections = _layout(case), list(case.sections or (0, 0, 0))
    q, k = q.detach(), k.detach()
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
    fwd = lambda: _rotated(q, k, positions, inv_freq, layout, sections, 1.0, False)
    bwd = lambda: _rotated(grad_q, grad_k, positions, inv_freq, layout, sections, 1.0, True)
    t_fwd = bench_ms(fwd)
    t_fb = bench_ms(lambda: (fwd(), bwd()))
    return _row(case.name, "ours_kernels_only", t_fwd, t_fb, moved_bytes)


def _inplace_rows(case, q, k, positions, inv_freq, rows) -> None:
    """In-place partial rotary: only the R lanes move, both passes; floor = copying those lanes once per pass."""
    rot, layout = case.rotary_dim, triton_rope.LAYOUT_INTERLEAVED
    q, k = q.detach().clone(), k.detach().clone()
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
    sections = list(case.sections)
    rotary_bytes = 2 * (q[..., :rot].numel() + k[..., :rot].numel()) * q.element_size()

    def fwd():
        apply_mrope(q, k, positions, inv_freq, case.sections, case.interleaved, inplace=True)

    def fwd_bwd():
        fwd()
        _rotated(grad_q, grad_k, positions, inv_freq, layout, sections, 1.0, True)

    with torch.no_grad():
        t_fwd, t_fb = bench_ms(fwd), bench_ms(fwd_bwd)
        src_q, src_k = torch.randn_like(q), torch.randn_like(k)
        t_copy = bench_ms(lambda: (q[..., :rot].copy_(src_q[..., :rot]), k[..., :rot].copy_(src_k[..., :rot])))
        t_gradient_copy = bench_ms(lambda: (grad_q.clone(), grad_k.clone()))
    name = f"{case.name} IN-PLACE"
    rows.append(_row(name, "ours_inplace", t_fwd, t_fb, rotary_bytes))
    rows.append(_row(name, "copy_floor_rotary_lanes", t_copy, t_copy + t_gradient_copy, rotary_bytes))


def _sweep(case, q, k, positions, inv_freq, rows) -> None:
    """Forward time of (BLOCK_T, num_warps) variants of the launcher, to tune the heuristic."""
    layout = _layout(case)
    q, k = q.detach(), k.detach()
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    sections = case.sections or (0, 0, 0)
    for block_t, warps in [(1, 2), (1, 4), (2, 4), (4, 4), (8, 4), (2, 8), (4, 8), (8, 8), (16, 8)]:
        t = bench_ms(
            lambda bt=block_t, w=warps: triton_rope.rope_launch(
                q, k, qo, ko, positions, inv_freq, layout, sections, 1.0, False, block_t=bt, num_warps=w
            )
        )
        rows.append({"case": case.name, "impl": f"sweep_bt{block_t}_w{warps}", "fwd_us": t * 1e3})


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


def print_table(rows: list[dict]) -> None:
    floors = {r["case"]: r for r in rows if r["impl"].startswith("copy_floor")}
    print(
        f"{'case':48s} {'impl':24s} {'fwd µs':>8s} {'×floor':>7s} {'fwd+bwd µs':>11s} {'×floor':>7s} {'TB/s f/fb':>10s}"
    )
    for r in rows:
        if "fwdbwd_us" not in r:
            continue
        floor = floors[r["case"]]
        print(
            f"{r['case']:48s} {r['impl']:24s} {r['fwd_us']:8.1f} {r['fwd_us'] / floor['fwd_us']:7.2f} "
            f"{r['fwdbwd_us']:11.1f} {r['fwdbwd_us'] / floor['fwdbwd_us']:7.2f} "
            f"{r['fwd_tbps']:4.2f}/{r['fwdbwd_tbps']:4.2f}"
        )
    sweep = [r for r in rows if r["impl"].startswith("sweep")]
    if sweep:
        print("\nlaunch-config sweep (fwd µs):")
        for r in sweep:
            print(f"  {r['case']:48s} {r['impl']:20s} {r['fwd_us']:8.1f}")


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
    parser.add_argument("--out", default="artifacts/bench", help="folder for bench_mrope.json and bench_mrope.png")
    parser.add_argument("--tokens", type=int, default=16384, help="packed tokens T")
    parser.add_argument("--sweep", action="store_true", help="also time launch-config variants of our kernel")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mrope needs a CUDA GPU")
    torch.manual_seed(0)
    rows: list[dict] = []
    for case in CASES:
        run_case(case, args.tokens, rows, args.sweep)
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tokens": args.tokens,
        "dtype": "bfloat16",
    }
    print(" ".join(f"{k}={v}" for k, v in meta.items()))
    print_table(rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_mrope.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    plot(rows, os.path.join(args.out, "bench_mrope.png"))


if __name__ == "__main__":
    main()
