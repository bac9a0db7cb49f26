"""The kernel-level speed levers on the recipes' own shapes, each against what it replaces and an fp32 reference:
the packed attention engines (`attention_main`, scripts/bench_attention.py) and float8 linears (`fp8_main`,
scripts/bench_fp8.py).

Packed attention engines on the recipes' own shapes: forward + backward time and error against an fp32 reference.

    python -m scripts.bench_attention --out artifacts/bench/attention.json      # GPU; one H100/H200 takes ~2 min

Engines (modeling/attention_engines.py; flex only here):
- fa2: `kernels.attention=fa2` — flash-attn 2 when installed, else torch's `varlen_attn`.
- fa4: `kernels.attention=fa4` — flash-attn-4's CuTe kernels through our custom ops (skipped where not installed).
- flex: torch's FlexAttention, compiled, under a document (and causal) BlockMask built from cu_seqlens; the mask's
  build time is reported beside (one build per pack and per boundary set: the LLM's layers share one).

Cases: each recipe's text attention (16k-token packs of samples 370–1,140 tokens long: an image of 256–1,024 LLM
tokens and its text) and its ViT (the same images as patches, 4 per LLM token: full attention per image, and
Qwen2.5-VL's 64-patch windows). Each case draws q, k, v, dout once (bf16, seeded), checks every engine's out, dq, dk,
dv against per-document SDPA on fp32 copies (‖x − ref‖ / ‖ref‖, the error printed beside fa2's own), then times
forward + backward with `triton.testing.do_bench` (median ms).

FP8 linears (torchao float8 training) against bf16 on the recipes' own layer shapes, compiled, forward + backward.

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
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from modeling import attention_engines
from verification.provenance import provenance


@dataclass(frozen=True)
class Case:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    lengths: tuple[int, ...]


def sample_lengths(total: int, low: int, high: int, seed: int, scale: int = 1) -> tuple[int, ...]:
    """Document lengths drawn uniformly from [low, high] (times `scale`) until `total` is filled; the last is cut."""
    rng, lengths, filled = random.Random(seed), [], 0
    while filled < total:
        length = min(rng.randint(low, high) * scale, total - filled)
        lengths.append(length)
        filled += length
    return tuple(lengths)


def recipe_cases(tokens: int = 16384, seed: int = 0) -> list[Case]:
    """Text and ViT attention of the shipped one-GPU recipes (recipes/models/*.json), one pack each."""
    text = sample_lengths(tokens, 370, 1140, seed)
    images = tuple(4 * max(n - 112, 16) for n in text)  # each sample's image as ViT patches (2×2 merge), not its text
    windows = tuple(64 for _ in range(sum(images) // 64))
    return [
        Case("qwen3_vl-2b text 16/8×128", 16, 8, 128, True, text),
        Case("qwen2_5_vl-3b text 16/2×128", 16, 2, 128, True, text),
        Case("qwen3_5-2b text 8/2×256", 8, 2, 256, True, text),
        Case("qwen3_vl-8b text 32/8×128", 32, 8, 128, True, text),
        Case("qwen2_5_vl ViT full 16×80", 16, 16, 80, False, images),
        Case("qwen2_5_vl ViT windows 16×80", 16, 16, 80, False, windows),
        Case("qwen3_vl-2b ViT 16×64", 16, 16, 64, False, images),
        Case("qwen3_vl-8b ViT 16×72", 16, 16, 72, False, images),
    ]


def reference(q, k, v, dout, lengths, scale, causal):
    """Per-document SDPA in fp32: out, dq, dk, dv."""
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    qf, kf, vf = (t.transpose(0, 1)[None] for t in leaves)
    groups = qf.shape[1] // kf.shape[1]
    outs = []
    for qs, ks, vs in zip(*(t.split(list(lengths), dim=2) for t in (qf, kf, vf))):
        ks, vs = (t.repeat_interleave(groups, dim=1) for t in (ks, vs))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale))
    out = torch.cat(outs, dim=2)[0].transpose(0, 1)
    out.backward(dout.float())
    return [out.detach(), *(t.grad for t in leaves)]


def flex_runner(case: Case, cu_seqlens: torch.Tensor, total: int, device: torch.device):
    """A compiled flex_attention call under the case's document BlockMask, and the mask's build time in ms."""
    import triton.testing
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def build():
        document = torch.searchsorted(cu_seqlens[1:], torch.arange(total, device=device), right=True)

        def mask_mod(b, h, q_idx, kv_idx):
            same = document[q_idx] == document[kv_idx]
            return same & (q_idx >= kv_idx) if case.causal else same

        return create_block_mask(mask_mod, None, None, total, total, device=device)

    block_mask = build()
    build_ms = triton.testing.do_bench(build, warmup=5, rep=50, return_mode="median")
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, scale):
        qf, kf, vf = (t.transpose(0, 1)[None] for t in (q, k, v))
        out = compiled(qf, kf, vf, block_mask=block_mask, scale=scale, enable_gqa=case.heads != case.kv_heads)
        return out[0].transpose(0, 1)

    return run, build_ms


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm())


def measure(runner, inputs: tuple, dout: torch.Tensor, scale: float, ref: list, rep_ms: int) -> dict:
    """Error of out, dq, dk, dv against `ref`, then median fwd+bwd and fwd-only times of `runner`."""
    import triton.testing

    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = runner(*leaves, scale)
    out.backward(dout)
    names = ("out", "dq", "dk", "dv")
    error = {name: relative_error(x, r) for name, x, r in zip(names, [out, *(t.grad for t in leaves)], ref)}

    def step():
        for t in leaves:
            t.grad = None
        runner(*leaves, scale).backward(dout)

    def forward():
        with torch.no_grad():
            runner(*leaves, scale)

    return {
        "error": error,
        "fwd_bwd_ms": triton.testing.do_bench(step, warmup=25, rep=rep_ms, return_mode="median"),
        "fwd_ms": triton.testing.do_bench(forward, warmup=25, rep=rep_ms, return_mode="median"),
    }


def run_case(case: Case, engines: list[str], device: torch.device, seed: int, rep_ms: int) -> dict:
    torch.manual_seed(seed)
    total = sum(case.lengths)
    q = torch.randn(total, case.heads, case.head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(total, case.kv_heads, case.head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn(total, case.kv_heads, case.head_dim, device=device, dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    scale = case.head_dim**-0.5
    cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], device=device, dtype=torch.int32)
    max_len = max(case.lengths)
    ref = reference(q, k, v, dout, case.lengths, scale, case.causal)
    row = {
        "case": case.name,
        "tokens": total,
        "documents": len(case.lengths),
        "max_document": max_len,
        "causal": case.causal,
        "engines": {},
    }
    for engine in engines:
        record: dict = {}
        try:
            if engine == "flex":
                runner, record["mask_build_ms"] = flex_runner(case, cu, total, device)
            else:
                name = engine

                def runner(q, k, v, scale, name=name):
                    return attention_engines.varlen_attention(
                        name, q, k, v, cu, cu, max_len, max_len, scale, case.causal
                    )

            record.update(measure(runner, (q, k, v), dout, scale, ref, rep_ms))
        except Exception as error:  # an engine that cannot run this case is recorded, the others still run
            record = {"failed": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        row["engines"][engine] = record
    base = row["engines"].get("fa2", {}).get("fwd_bwd_ms")
    for record in row["engines"].values():
        if base and "fwd_bwd_ms" in record:
            record["speedup_vs_fa2"] = base / record["fwd_bwd_ms"]
    return row


def format_attention_table(rows: list[dict], engines: list[str]) -> str:
    head = "| case | docs | " + " | ".join(f"{e} fwd+bwd ms (×fa2) [fwd] · err out/dq" for e in engines) + " |"
    lines = [head, "|" + "---|" * (2 + len(engines))]
    for row in rows:
        cells = []
        for engine in engines:
            r = row["engines"].get(engine, {})
            if "fwd_bwd_ms" not in r:
                cells.append(r.get("failed", "–")[:60])
                continue
            err = r["error"]
            cells.append(
                f"{r['fwd_bwd_ms']:.3f} ({r.get('speedup_vs_fa2', 1):.2f}×) [{r['fwd_ms']:.3f}]"
                f" · {err['out']:.1e}/{err['dq']:.1e}"
            )
        lines.append(f"| {row['case']} | {row['documents']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_attention_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="fa2,fa4,flex", help="comma-separated: fa2, fa4, flex")
    parser.add_argument(
        "--cases", default="", help="substrings of case names to keep (comma-separated); all by default"
    )
    parser.add_argument("--tokens", type=int, default=16384, help="LLM tokens per pack")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench's timing window per measurement")
    parser.add_argument("--out", default=None, help="write the rows and provenance as JSON here")
    return parser.parse_args(argv)


def attention_main(argv: list[str] | None = None) -> int:
    args = parse_attention_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU: the engines it times are GPU kernels.")
    device = torch.device("cuda")
    engines = [e for e in args.engines.split(",") if e]
    wanted = [s for s in args.cases.split(",") if s]
    cases = [c for c in recipe_cases(args.tokens, args.seed) if not wanted or any(s in c.name for s in wanted)]
    rows = []
    for case in cases:
        rows.append(run_case(case, engines, device, args.seed, args.rep_ms))
        print(json.dumps(rows[-1]), flush=True)
    table = format_attention_table(rows, engines)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        record = {
            "command": "python -m scripts.bench_attention " + " ".join(argv or []),
            "fa2_kernel": attention_engines.fa2_kernel_name(),
            "provenance": provenance(),
            "rows": rows,
            "table": table,
        }
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


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


def format_fp8_table(rows: list[dict], variants: list[str]) -> str:
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


def fp8_main(argv: list[str] | None = None) -> int:
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
    table = format_fp8_table(rows, variants)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        record = {"command": "python -m scripts.bench_fp8 " + " ".join(argv or []), "provenance": provenance()}
        Path(args.out).write_text(json.dumps({**record, "rows": rows, "table": table}, indent=2) + "\n")
    return 0
