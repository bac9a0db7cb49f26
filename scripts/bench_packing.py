"""Throughput of packed varlen batches vs padded batches vs sdpa with a packed (block-diagonal) mask.

Forward+backward of a mid-size Qwen2.5-VL-shaped model (4 decoder layers with Qwen2.5-VL-3B dims, a small ViT, bf16)
through train.py's own training module (trainer.step.TrainModule: the model and its fused lm_head + cross-entropy)
on the same samples three ways:

- packed-varlen: packs of `--max-tokens` (the data pipeline's best-fit-decreasing), modeling/packed.py attention;
- padded-sdpa: `--padded-batch-size` consecutive samples right-padded to the longest, transformers' sdpa;
- packed-sdpa-mask: the same packs with transformers' sdpa, which builds a (1,1,T,T) block-diagonal mask.

Samples: the built-in dataset (lengths, layouts and image grids from the tiny Qwen2.5-VL recipe's pipeline; random
pixels) and a long-tailed synthetic mix (log-normal text lengths, half the samples with one image). Throughput counts
real (non-pad) tokens. Prints a table and writes JSON to --out. About two minutes on an H200.

    python -m scripts.bench_packing --out artifacts/bench_packing.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

from core.config import ModelConfig, load_config
from data.collate import label_rows
from data.packing import PackItem, best_fit_decreasing
from data.pipeline import build_data, load_processor
from data.processing import IGNORE_INDEX
from modeling.build import build_model
from modeling.packed import attention_implementation, enable_packed_forward
from trainer.step import TrainModule
from verification.packing_check import (
    Sample,
    SampleSpec,
    pack_samples,
    samples_from_batch,
    synthetic_sample,
)
from verification.provenance import provenance

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT_3B = {  # Qwen2.5-VL-3B text dims, 4 layers
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
}
SMALL_VIT = {  # Qwen2.5-VL ViT width, 4 blocks (two windowed, two full)
    "depth": 4,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 2048,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [1, 3],
}
TINY_TEXT = {  # --tiny: the same shapes scaled down, for a CPU run of the script itself
    **TEXT_3B,
    "vocab_size": 2048,
    "bos_token_id": None,
    "eos_token_id": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
}
TINY_VIT = {**SMALL_VIT, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
TOKEN_IDS = {"image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 3, "vision_end_token_id": 4}


@dataclass
class Result:
    dataset: str
    variant: str
    tokens_per_s: float
    real_tokens: int
    computed_tokens: int
    steps: int
    seconds: float


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="artifacts/bench_packing.json")
    parser.add_argument("--max-tokens", type=int, default=8192, help="pack budget")
    parser.add_argument("--padded-batch-size", type=int, default=8)
    parser.add_argument("--num-samples", type=int, default=600, help="samples per dataset")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("--max-seconds", type=float, default=8.0, help="timed seconds per variant, at most")
    parser.add_argument("--tiny", action="store_true", help="tiny dims: a CPU smoke run of this script")
    return parser.parse_args()


def bench_model(tiny: bool, device: str) -> torch.nn.Module:
    text, vit = (TINY_TEXT, TINY_VIT) if tiny else (TEXT_3B, SMALL_VIT)
    dtype = "float32" if device == "cpu" else "bfloat16"
    config = {"model_type": "qwen2_5_vl", **TOKEN_IDS, "text_config": text, "vision_config": vit}
    return build_model(ModelConfig(config=config, dtype=dtype), attn_implementation="sdpa").to(device)


def builtin_samples(config, count: int, max_tokens: int, generator: torch.Generator) -> list[Sample]:
    """The built-in dataset's samples as the tiny Qwen2.5-VL pipeline makes them; pixels redrawn for `config`."""
    cfg = load_config(os.path.join(REPO, "recipes/tiny-qwen2_5_vl.yaml"), [f"packing.max_tokens={max_tokens}"])
    loader, _, _ = build_data(
        cfg.data, cfg.packing, load_processor(cfg.model, cfg.data), config, grad_accum_steps=cfg.train.grad_accum_steps
    )
    patch = 3 * config.vision_config.temporal_patch_size * config.vision_config.patch_size**2
    merge = config.vision_config.spatial_merge_size
    samples: list[Sample] = []
    for batch in loader:
        for sample in samples_from_batch(batch, merge):
            if sample.image_grid_thw is not None:
                patches = int(sample.image_grid_thw.prod(-1).sum())
                sample.pixel_values = torch.randn(patches, patch, generator=generator)
            samples.append(sample)
        if len(samples) >= count:
            return samples[:count]
    return samples


def long_tailed_samples(config, count: int, max_tokens: int, generator: torch.Generator) -> list[Sample]:
    """Log-normal text lengths (median 200, σ 1.2, capped at half the budget); every other sample has one image."""
    specs = []
    for index in range(count):
        text = int(min(max_tokens // 2, max(4, math.exp(math.log(200) + 1.2 * torch.randn(1, generator=generator)))))
        if index % 2:
            h, w = (2 * int(torch.randint(2, 17, (1,), generator=generator)) for _ in range(2))
            specs.append(SampleSpec(text // 4, ((h, w),), text_after=text - text // 4))
        else:
            specs.append(SampleSpec(text))
    return [synthetic_sample(config, spec, generator) for spec in specs]


def packs_of(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    items = [PackItem(key=i, length=len(s), num_patches=0) for i, s in enumerate(samples)]
    return [[samples[item.key] for item in pack.items] for pack in best_fit_decreasing(items, max_tokens)]


def padded_batch(model, samples: list[Sample]) -> dict:
    """Right-padded (B, S) batch with attention_mask and each sample's own (4, B, S) positions."""
    width, rows = max(len(s) for s in samples), len(samples)
    batch = {
        "input_ids": torch.zeros(rows, width, dtype=torch.long),
        "attention_mask": torch.zeros(rows, width, dtype=torch.long),
        "mm_token_type_ids": torch.zeros(rows, width, dtype=torch.int32),
        "position_ids": torch.zeros(4, rows, width, dtype=torch.long),
        "shift_labels": torch.full((rows, width), IGNORE_INDEX, dtype=torch.long),
    }
    single = pack_samples(model, samples)
    for row, (sample, start) in enumerate(zip(samples, single["cu_seqlens"].tolist())):
        n = len(sample)
        batch["input_ids"][row, :n] = sample.input_ids
        batch["attention_mask"][row, :n] = 1
        batch["mm_token_type_ids"][row, :n] = sample.mm_token_type_ids
        batch["position_ids"][:, row, :n] = single["position_ids"][:, 0, start : start + n]
        batch["shift_labels"][row, :n] = sample.shift_labels
    batch["pixel_values"], batch["image_grid_thw"] = single["pixel_values"], single["image_grid_thw"]
    batch["label_rows"] = label_rows(batch["shift_labels"])
    return batch


def _on(batch: dict, device: str, dtype: torch.dtype) -> dict:
    return {
        k: v.to(device, dtype if v.is_floating_point() else None) if torch.is_tensor(v) else v for k, v in batch.items()
    }


def without_pack(batch: dict) -> dict:
    """The pack as one (1, T) row without its boundaries: transformers' sdpa then masks it from the positions."""
    return {k: v for k, v in batch.items() if k not in ("cu_seqlens", "max_seqlen", "sample_lengths", "seq_idx")}


def run_variant(
    module: TrainModule, batches: list[dict], warmup: int, max_seconds: float
) -> tuple[int, int, int, float]:
    """Forward+backward of the training module (the loss train.py uses) over `batches`, the first `warmup` untimed;
    (real tokens, computed tokens, steps, seconds)."""
    model = module.model
    device = next(model.parameters()).device

    def step(batch: dict) -> None:
        num_labels = int((batch["shift_labels"] != IGNORE_INDEX).sum())
        (module(batch) / num_labels).backward()

    for batch in batches[:warmup]:
        step(batch)
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    real = computed = steps = 0
    start = time.perf_counter()
    for batch in batches[warmup:]:
        step(batch)
        real += int(batch["real_tokens"])
        computed += batch["input_ids"].numel()
        steps += 1
        if time.perf_counter() - start > max_seconds:
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return real, computed, steps, time.perf_counter() - start


def bench_dataset(module: TrainModule, name: str, samples: list[Sample], args, device: str) -> list[Result]:
    model = module.model
    packs = [
        pack_samples(model, p) | {"real_tokens": sum(len(s) for s in p)} for p in packs_of(samples, args.max_tokens)
    ]
    size = args.padded_batch_size
    padded = [
        padded_batch(model, samples[i : i + size]) | {"real_tokens": sum(len(s) for s in samples[i : i + size])}
        for i in range(0, len(samples), size)
    ]
    packs, padded = ([_on(b, device, model.dtype) for b in group] for group in (packs, padded))
    variants = {
        "packed-varlen": (packs, None),
        "padded-sdpa": (padded, "sdpa"),
        "packed-sdpa-mask": ([without_pack(b) for b in packs], "sdpa"),
    }
    results = []
    for variant, (batches, attention) in variants.items():
        context = attention_implementation(model, attention) if attention else contextlib.nullcontext()
        with context:
            real, computed, steps, seconds = run_variant(module, batches, args.warmup, args.max_seconds)
        results.append(Result(name, variant, real / seconds, real, computed, steps, seconds))
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def main() -> int:
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = bench_model(args.tiny, device)
    model.train()
    enable_packed_forward(model)
    generator = torch.Generator().manual_seed(0)
    datasets = {
        "builtin": builtin_samples(model.config, args.num_samples, args.max_tokens, generator),
        "long-tailed": long_tailed_samples(model.config, args.num_samples, args.max_tokens, generator),
    }
    module = TrainModule(model, vision_alignment="any_call").to(device)  # one process, as train.py builds it
    results = [r for name, samples in datasets.items() for r in bench_dataset(module, name, samples, args, device)]

    print(f"{'dataset':12} {'variant':17} {'tokens/s':>11} {'real tok':>9} {'computed':>9} {'vs padded':>9}")
    for result in results:
        padded = next(r for r in results if r.dataset == result.dataset and r.variant == "padded-sdpa")
        print(
            f"{result.dataset:12} {result.variant:17} {result.tokens_per_s:11.0f} {result.real_tokens:9d} "
            f"{result.computed_tokens:9d} {result.tokens_per_s / padded.tokens_per_s:8.2f}x"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "provenance": provenance(),
                "model": {"text": TINY_TEXT if args.tiny else TEXT_3B, "vision": TINY_VIT if args.tiny else SMALL_VIT},
                "args": vars(args),
                "results": [asdict(r) for r in results],
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
