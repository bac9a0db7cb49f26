"""Qwen3.5 Gated DeltaNet on a packed batch: fla's varlen kernels vs the repo's boundary-exact torch path (GPU).

Three measurements, one process, printed as tables and written as JSON to --out:

1. Exactness of fla's varlen `chunk_gated_delta_rule` (bf16) against transformers' torch delta rule run per sample
   in fp32: relative error of o, dq, dk, dv, dg and dβ, beside the torch path's own bf16 error. The pack holds
   --tokens tokens in samples of uneven lengths including 1, 63, 64 and 65 (modeling/gated_delta_check.py).
2. fla's first call (Triton compile and autotuning, or their on-disk cache: run the script twice with the same
   TRITON_CACHE_DIR to see both) and its warm time.
3. One Gated DeltaNet layer of the recipe (default: recipes/bench-qwen3_5-shape.yaml, Qwen3.5's real widths),
   forward+backward on the pack, bf16: the fla backend vs the torch backend (modeling/gated_delta.py), the layer's
   dense projections alone (the same matmuls under either backend; the layer's time beyond them is what a backend
   changes), and the delta rule alone (fla varlen vs transformers' torch rule per sample); medians of CUDA-event
   timings.

    python -m scripts.bench_gated_delta --out artifacts/bench_gated_delta.json [--tokens 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import torch

from core.config import load_config
from core.families import hf_config, model_class
from modeling import gated_delta, gated_delta_check
from modeling.gated_delta_check import GatedDeltaDims
from modeling.packed import PACK_KWARG, PackedSeqlens
from verification.provenance import provenance

EDGE_LENGTHS = (1, 63, 64, 65)


def pack_lengths(tokens: int) -> tuple[int, ...]:
    """Uneven sample lengths summing to `tokens`: the chunk-boundary cases, then long samples of varied size."""
    lengths, left, long_sizes = list(EDGE_LENGTHS), tokens - sum(EDGE_LENGTHS), (3000, 5000, 700, 7684, 1111)
    for size in long_sizes * (1 + tokens // sum(long_sizes)):
        if left <= 0:
            break
        lengths.append(min(size, left))
        left -= lengths[-1]
    return tuple(lengths)


def cuda_median_ms(fn, repeats: int) -> tuple[float, float, float]:
    """(median, min, max) of `repeats` timed calls, CUDA events around each, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), min(times), max(times)


def triton_cache_files() -> int:
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return sum(1 for _ in root.rglob("*")) if root.exists() else 0


def gdn_layer(recipe: str, dtype: torch.dtype) -> torch.nn.Module:
    """The recipe's first Gated DeltaNet layer, randomly initialised, on the GPU."""
    config = hf_config(load_config(recipe).model)
    text_config = config.text_config
    modeling = sys.modules[model_class(config).__module__]
    layer_class = next(getattr(modeling, name) for name in dir(modeling) if name.endswith("GatedDeltaNet"))
    layer_idx = text_config.layer_types.index("linear_attention")
    return layer_class(text_config, layer_idx=layer_idx).to("cuda", dtype)


def time_layer(layer, backend: str, pack: PackedSeqlens, repeats: int) -> tuple[float, float, float]:
    gated_delta.patch_gated_delta_layers(layer, PACK_KWARG, backend)
    hidden = torch.randn(1, pack.total_tokens, layer.hidden_size, device="cuda", dtype=layer.out_proj.weight.dtype)
    hidden.requires_grad_(True)
    grad = torch.randn_like(hidden)

    def step():
        layer(hidden, **{PACK_KWARG: pack}).backward(grad)

    try:
        return cuda_median_ms(step, repeats)
    finally:
        gated_delta.unpatch_gated_delta_layers(layer)


def time_projections(layer, tokens: int, repeats: int) -> tuple[float, float, float]:
    """Forward+backward of the layer's dense projections alone (its in_proj_* from the hidden states, out_proj to
    them): the matmuls both backends run identically, so the part of the layer a backend can speed up is the rest."""
    in_projs = [module for name, module in layer.named_children() if name.startswith("in_proj")]
    dtype = layer.out_proj.weight.dtype
    hidden = torch.randn(tokens, layer.hidden_size, device="cuda", dtype=dtype, requires_grad=True)
    core = torch.randn(tokens, layer.out_proj.in_features, device="cuda", dtype=dtype, requires_grad=True)

    def step():
        outputs = [proj(hidden) for proj in in_projs] + [layer.out_proj(core)]
        torch.autograd.backward(outputs, [torch.ones_like(out) for out in outputs])

    return cuda_median_ms(step, repeats)


def time_delta_rule(rule, dims: GatedDeltaDims, lengths, cu_seqlens, repeats: int) -> tuple[float, float, float]:
    """Forward+backward of the delta rule alone on the pack, bf16 inputs (g fp32, as the layer feeds it)."""
    generator = torch.Generator().manual_seed(0)
    *inputs, grad_o = gated_delta_check.delta_rule_inputs(dims, lengths, torch.bfloat16, "cuda", generator)
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    return cuda_median_ms(lambda: rule(*leaves, cu_seqlens).backward(grad_o), repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/bench-qwen3_5-shape.yaml")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="artifacts/bench_gated_delta.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    blocker = gated_delta.fla_blocker()
    if blocker:
        parser.error(blocker)

    dtype = torch.bfloat16
    layer = gdn_layer(args.recipe, dtype)
    dims = GatedDeltaDims.of(layer)
    lengths = pack_lengths(args.tokens)
    cache_files = triton_cache_files()
    from fla.ops.common import chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True  # measured here, not trusted: this script reports fla's error itself

    start = time.perf_counter()
    first = gated_delta_check.check_delta_rule(gated_delta.fla_delta_rule, dims, dtype, "cuda", lengths=(64, 65))
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start
    accuracy = gated_delta_check.check_delta_rule(gated_delta.fla_delta_rule, dims, dtype, "cuda", lengths=lengths)

    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    pack = PackedSeqlens(cu_seqlens, max(lengths), lengths)
    layer_ms = {backend: time_layer(layer, backend, pack, args.repeats) for backend in ("fla", "torch")}
    projections_ms = time_projections(layer, pack.total_tokens, args.repeats)
    beyond_projections = {backend: ms[0] - projections_ms[0] for backend, ms in layer_ms.items()}
    rule_ms = {
        "fla": time_delta_rule(gated_delta.fla_delta_rule, dims, lengths, cu_seqlens, args.repeats),
        "torch per sample": time_delta_rule(
            gated_delta_check.torch_delta_rule_per_sample, dims, lengths, cu_seqlens, max(3, args.repeats // 3)
        ),
    }

    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "provenance": provenance(),
        "versions": gated_delta_check.environment_key(dims, dtype, torch.device("cuda")),
        "dims": asdict(dims),
        "lengths": lengths,
        "triton_cache_files_at_start": cache_files,
        "first_call_s": first_call_s,
        "first_call_passed": first.passed,
        "accuracy": asdict(accuracy),
        "accuracy_passed": accuracy.passed,
        "layer_fwd_bwd_ms": {b: dict(zip(("median", "min", "max"), t, strict=True)) for b, t in layer_ms.items()},
        "speedup_fla_over_torch": layer_ms["torch"][0] / layer_ms["fla"][0],
        "projections_fwd_bwd_ms": dict(zip(("median", "min", "max"), projections_ms, strict=True)),
        "layer_beyond_projections_ms": beyond_projections,
        "speedup_beyond_projections": beyond_projections["torch"] / beyond_projections["fla"],
        "delta_rule_fwd_bwd_ms": {b: dict(zip(("median", "min", "max"), t, strict=True)) for b, t in rule_ms.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))

    print(f"{result['provenance']['gpu']['name']}; {result['versions']}")
    print(f"pack: {len(lengths)} samples, {sum(lengths)} tokens: {lengths}")
    print(f"fla first call (compile + autotune; {cache_files} files in the Triton cache at start): {first_call_s:.1f}s")
    print(f"{'path':26}" + "".join(f"{q:>9}" for q in gated_delta_check.QUANTITIES))
    for name, errors in (("fla bf16", accuracy.errors), ("torch bf16 (own rounding)", accuracy.torch_errors)):
        print(f"{name:26}" + "".join(f"{errors[q]:9.1e}" for q in gated_delta_check.QUANTITIES))
    print(f"self-check verdict at this size: {'pass' if accuracy.passed else 'FAIL'} ({accuracy.worst()})")
    for backend, (median, low, high) in layer_ms.items():
        print(f"GDN layer fwd+bwd, {backend:5}: {median:8.2f} ms (min {low:.2f}, max {high:.2f})")
    print(f"fla / torch speedup: {result['speedup_fla_over_torch']:.1f}x")
    print(
        f"the projections alone (both backends): {projections_ms[0]:.2f} ms; the layer beyond them: fla "
        f"{beyond_projections['fla']:.2f} ms, torch {beyond_projections['torch']:.2f} ms, "
        f"{result['speedup_beyond_projections']:.1f}x"
    )
    for rule, (median, low, high) in rule_ms.items():
        print(f"delta rule alone fwd+bwd, {rule:16}: {median:8.2f} ms (min {low:.2f}, max {high:.2f})")
    return 0 if accuracy.passed else 1


if __name__ == "__main__":
    sys.exit(main())
