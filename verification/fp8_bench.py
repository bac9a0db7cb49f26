"""FP8 linears (torchao float8 training) against bf16 on the recipes' own layer shapes, compiled, forward + backward.

    python -m scripts.bench_fp8 --out artifacts/bench/fp8.json      # GPU (Hopper or newer); ~2 min on one H100

Each case is one decoder layer's matmul work at a 16k-token pack (a multiple of 16 rows: the padding modeling/fp8.py
adds is left out): the MLP (gate and up projections, SiLU·mul, down projection) and the attention projections (q, k,
v, o) with the recipe's widths, bf16 weights as the recipes train them. Variants: bf16; torchao's `rowwise` and
`tensorwise` float8 recipes (`convert_to_float8_training` on every linear of the block). Each is compiled (float8
without compile is slower than bf16: its casts and scales are separate kernels) and timed with
`triton.testing.do_bench` (median ms of forward + backward); the output's error against an fp32 copy of the block
is printed beside (‖x − ref‖ / ‖ref‖).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from verification.provenance import provenance

# (name, hidden, intermediate, q heads × head dim, kv heads × head dim)
SHAPES = (
    ("qwen3_vl-2b", 2048, 6144, 16 * 128, 8 * 128),
    ("qwen2_5_vl-3b", 2048, 11008, 16 * 128, 2 * 128),
    ("qwen3_5-2b", 2048, 6144, 8 * 256, 2 * 256),
    ("qwen3_vl-8b", 4096, 12288, 32 * 128, 8 * 128),
    ("qwen2_5_vl ViT", 1280, 3420, 1280, 1280),
)


class Block(nn.Module):
    """One layer's matmuls: attention projections then the gated MLP (the attention itself left out)."""

    def __init__(self, hidden: int, intermediate: int, q_width: int, kv_width: int):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(hidden, q_width), nn.Linear(hidden, kv_width), nn.Linear(hidden, kv_width)
        self.o = nn.Linear(q_width, hidden, bias=False)
        self.gate, self.up = nn.Linear(hidden, intermediate, bias=False), nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.o(self.q(x)) + self.k(x).sum(-1, keepdim=True) + self.v(x).sum(-1, keepdim=True)
        h = x + attn
        return h + self.down(F.silu(self.gate(h)) * self.up(h))


def variant(block: Block, name: str) -> nn.Module:
    if name == "bf16":
        return block
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(copy.deepcopy(block), config=Float8LinearConfig.from_recipe_name(name))


def run_shape(shape: tuple, variants: list[str], tokens: int, rep_ms: int) -> dict:
    import triton.testing

    name, hidden, intermediate, q_width, kv_width = shape
    torch.manual_seed(0)
    block = Block(hidden, intermediate, q_width, kv_width).cuda().to(torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(x)
    ref = copy.deepcopy(block).float()(x.float()).detach()
    row = {"shape": name, "hidden": hidden, "intermediate": intermediate, "tokens": tokens, "variants": {}}
    for variant_name in variants:
        try:
            # every variant shares Block.forward's code: a fresh dynamo cache keeps each compiled (not past the limit)
            torch._dynamo.reset()
            module = torch.compile(variant(block, variant_name))
            leaf = x.detach().clone().requires_grad_()

            def step(module=module, leaf=leaf):
                leaf.grad = None
                module(leaf).backward(dout)

            error = float((module(leaf).detach().float() - ref).norm() / ref.norm())
            row["variants"][variant_name] = {
                "fwd_bwd_ms": triton.testing.do_bench(step, warmup=25, rep=rep_ms, return_mode="median"),
                "error": error,
            }
        except Exception as error:  # a variant that cannot run is recorded, the others still run
            row["variants"][variant_name] = {"failed": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    base = row["variants"].get("bf16", {}).get("fwd_bwd_ms")
    for record in row["variants"].values():
        if base and "fwd_bwd_ms" in record:
            record["speedup_vs_bf16"] = base / record["fwd_bwd_ms"]
    return row


def format_table(rows: list[dict], variants: list[str]) -> str:
    lines = [
        "| shape | " + " | ".join(f"{v} ms (×bf16) · err" for v in variants) + " |",
        "|" + "---|" * (1 + len(variants)),
    ]
    for row in rows:
        cells = []
        for v in variants:
            r = row["variants"].get(v, {})
            cells.append(
                f"{r['fwd_bwd_ms']:.3f} ({r['speedup_vs_bf16']:.2f}×) · {r['error']:.1e}"
                if "fwd_bwd_ms" in r
                else r.get("failed", "–")[:60]
            )
        lines.append(f"| {row['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="bf16,rowwise,tensorwise")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8 needs a CUDA GPU with float8 matmuls (compute capability 8.9 or newer).")
    variants = [v for v in args.variants.split(",") if v]
    rows = []
    for shape in SHAPES:
        rows.append(run_shape(shape, variants, args.tokens, args.rep_ms))
        print(json.dumps(rows[-1]), flush=True)
    table = format_table(rows, variants)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        record = {"command": "python -m scripts.bench_fp8 " + " ".join(argv or []), "provenance": provenance()}
        Path(args.out).write_text(json.dumps({**record, "rows": rows, "table": table}, indent=2) + "\n")
    return 0
