"""Generation throughput: new tokens per second of `model.generate` (KV cache, greedy) per batch size, on held-out
built-in prompts, for a trained run or for a recipe's model at its real width (random init: no download).

    python -m scripts.bench_generate --run runs/smoke --batch-sizes 1,8,32 --out artifacts/bench/generate-smoke.json
    python -m scripts.bench_generate --config recipes/qwen2_5_vl-3b.yaml --batch-sizes 1,8,32 \\
        --out artifacts/bench/generate-qwen2_5_vl-3b.json

Every answer is made exactly `--new-tokens` long (min = max new tokens), so a random-init model's missing EOS and a
trained model's early one time the same work. Per batch size: the mean wall time of `--repeats` batches after one
warm-up batch (with a device sync), prompt tokens, new tokens per second, prefill share not separated. The JSON
records provenance (commit, GPU, library versions).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from core.config import load_config
from data.pipeline import load_processor
from inference import evaluate
from inference.generation import GenerationSettings, Generator
from inference.loading import load_run
from modeling.build import build_model
from verification.provenance import provenance


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="a run directory: its export (or --checkpoint)")
    source.add_argument("--config", help="a recipe: its model at full width, random init")
    parser.add_argument("--checkpoint", default="final")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def model_and_parts(args: argparse.Namespace, device: torch.device):
    """(model, processor, data settings, what it is) on `device` in the recipe's dtype on CUDA, fp32 on the CPU."""
    if args.run:
        loaded = load_run(args.run, args.checkpoint, device)
        return loaded.model, loaded.processor, loaded.data, f"run {args.run} ({loaded.source})"
    cfg = load_config(args.config)
    dtype = cfg.model.dtype if device.type == "cuda" else "float32"
    model = build_model(dataclasses.replace(cfg.model, dtype=dtype), seed=cfg.train.seed)
    return model.to(device).eval(), load_processor(cfg.model, cfg.data), cfg.data, f"recipe {args.config}"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, processor, data, what = model_and_parts(args, device)
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    count = max(sizes) * (args.repeats + 1)
    records, root, data = evaluate.open_eval_records(data, evaluate.BUILTIN, count, None, None)
    builder = evaluate.prompt_builder_for(processor, model.config, data, root)
    prompts = [p for p in (builder.build(records[i], i) for i in range(len(records))) if p.row is not None]
    settings = GenerationSettings(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
    generator = Generator(model, processor.tokenizer, evaluate.collator_for(processor, model.config), settings)
    results = []
    for size in sizes:
        batches = [prompts[i * size : (i + 1) * size] for i in range(args.repeats + 1)]
        generator.generate(batches[0])  # warm-up
        times = []
        for batch in batches[1:]:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            generator.generate(batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        mean = sum(times) / len(times)
        prompt_tokens = sum(p.length for batch in batches[1:] for p in batch) / args.repeats
        results.append(
            {
                "batch_size": size,
                "mean_batch_s": mean,
                "prompt_tokens_per_batch": prompt_tokens,
                "new_tokens_per_s": size * args.new_tokens / mean,
            }
        )
        print(json.dumps(results[-1]), flush=True)
    result = {"model": what, "device": str(device), "new_tokens": args.new_tokens, "results": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**result, "provenance": provenance()}, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
