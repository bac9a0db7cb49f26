"""Packed attention engines on the recipes' own shapes: forward + backward time and error against an fp32 reference.

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
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

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
    images = tuple(4 * (n - 112) for n in text)  # each sample's image as ViT patches (2×2 merge), its text left out
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


def format_table(rows: list[dict], engines: list[str]) -> str:
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    table = format_table(rows, engines)
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
