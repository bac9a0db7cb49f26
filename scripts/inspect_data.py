"""Load, process and pack a recipe's data, and print what happened.

    python -m scripts.inspect_data --config recipes/tiny-qwen2_5_vl.yaml [dotted.key=value ...]

Prints samples kept/skipped (count per reason, first examples), packs and pack efficiency (real tokens / budget),
text vs image vs video tokens, image and video counts, ViT patches, the memory estimate per GPU for one process beside
the GPU memory it targets (scripts/estimate_memory.py), and a few decoded samples with the label mask: trained
(assistant) tokens in [[...]].
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.config import load_config
from core.config_tree import ConfigError
from core.families import hf_config
from data.formats import DataError
from data.pipeline import ProcessedRows, build_data, load_processor
from data.processing import IGNORE_INDEX
from trainer.memory_check import fit_report, gpu_targets


def describe_sample(
    tokenizer, input_ids: list[int], labels: list[int], image_token_id: int, video_token_id: int | None = None
) -> str:
    """The sample's text with trained tokens in [[...]] and each placeholder run shown as <image×N> / <video×N>."""
    pieces, run, run_trained = [], [], None

    def flush():
        if run:
            text = tokenizer.decode(run)
            pieces.append(f"[[{text}]]" if run_trained else text)

    for (token, label), group in itertools.groupby(zip(input_ids, labels, strict=True), key=lambda p: (p[0], p[1])):
        count = len(list(group))
        trained = label != IGNORE_INDEX
        if token in (image_token_id, video_token_id):
            flush()
            run, run_trained = [], None
            pieces.append(f"<{'image' if token == image_token_id else 'video'}×{count}>")
            continue
        if trained != run_trained:
            flush()
            run, run_trained = [], trained
        run += [token] * count
    flush()
    return "".join(pieces)


ROW_COUNTS = ("images", "image_patches", "videos", "video_temporal_patches", "video_patches", "frames", "video_samples")


def _grid_counts(column: pa.ChunkedArray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of a List(List(int)) grid column ((n, 3) grids per row): grids, t·h·w patches, t temporal patches."""
    per_row = pc.list_value_length(column).to_numpy()
    grids = pc.list_flatten(pc.list_flatten(column)).to_numpy().reshape(-1, 3).astype(np.int64)
    owner = np.repeat(np.arange(rows), per_row)
    patches = np.bincount(owner, weights=grids.prod(1), minlength=rows)
    temporal = np.bincount(owner, weights=grids[:, 0], minlength=rows)
    return per_row, patches.astype(np.int64), temporal.astype(np.int64)


def row_counts(table: pa.Table) -> np.ndarray:
    """(N, len(ROW_COUNTS)) int64: each processed row's ROW_COUNTS, from the arrow columns (no row is decoded)."""
    rows = table.num_rows
    images, image_patches, _ = _grid_counts(table.column("image_grid_thw"), rows)
    videos, video_patches, temporal = _grid_counts(table.column("video_grid_thw"), rows)
    videos_per_row = pc.list_value_length(table.column("videos")).to_numpy()
    frames_per_video = pc.list_value_length(pc.struct_field(pc.list_flatten(table.column("videos")), "frames"))
    owner = np.repeat(np.arange(rows), videos_per_row)
    frames = np.bincount(owner, weights=frames_per_video.to_numpy(), minlength=rows).astype(np.int64)
    return np.stack([images, image_patches, videos, temporal, video_patches, frames, videos > 0], 1).astype(np.int64)


def _row_count(row: dict) -> list[int]:
    """ROW_COUNTS of one processed row (a dict), as `row_counts` gives them."""
    images, videos = row["image_grid_thw"], row["video_grid_thw"]
    return [
        len(images),
        sum(t * h * w for t, h, w in images),
        len(videos),
        sum(t for t, _, _ in videos),
        sum(t * h * w for t, h, w in videos),
        sum(len(video["frames"]) for video in row["videos"]),
        bool(videos),
    ]


def epoch_totals(loader) -> dict[str, int]:
    """Epoch 0's planned packs, tokens, padded tokens (padded mode) and ROW_COUNTS summed over its samples.

    Walks the plan once, holding one step at a time: the in-memory mode marks the planned rows and sums their
    counts from the processed dataset's columns; the streaming mode (whose keys are the rows) sums row by row."""
    totals = dict.fromkeys(("packs", "tokens", "padded_tokens", *ROW_COUNTS), 0)
    in_memory = isinstance(loader.fetch, ProcessedRows)
    planned = np.zeros(len(loader.fetch.dataset) if in_memory else 0, dtype=bool)
    streamed = np.zeros(len(ROW_COUNTS), dtype=np.int64)
    for step in loader.steps(0):
        for pack in step:
            totals["packs"] += 1
            totals["tokens"] += pack.tokens
            totals["padded_tokens"] += len(pack.items) * max(item.length for item in pack.items)
            if in_memory:
                planned[[item.key for item in pack.items]] = True
            else:
                streamed += np.sum([_row_count(item.key) for item in pack.items], axis=0, dtype=np.int64)
    if in_memory:
        streamed = row_counts(loader.fetch.dataset.data.table)[planned].sum(0)
    return totals | dict(zip(ROW_COUNTS, streamed.tolist(), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument("--examples", type=int, default=3, help="decoded samples to show")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    cfg = load_config(args.config, args.overrides)
    model_config = hf_config(cfg.model)
    processor = load_processor(cfg.model, cfg.data)
    start = time.perf_counter()
    train_loader, _, stats = build_data(
        cfg.data, cfg.packing, processor, model_config, grad_accum_steps=cfg.train.grad_accum_steps
    )
    built = time.perf_counter() - start

    merge = model_config.vision_config.spatial_merge_size**2
    totals = epoch_totals(train_loader)
    packs, tokens = totals["packs"], totals["tokens"]
    image_tokens, video_tokens = totals["image_patches"] // merge, totals["video_patches"] // merge
    text_tokens = tokens - image_tokens - video_tokens
    print(f"data.path={cfg.data.path} streaming={cfg.data.streaming} (built in {built:.1f}s, cached after a first run)")
    print(f"samples: {stats.summary()}")
    for reason, examples in stats.skip_examples.items():
        for example in examples:
            print(f"  skipped {reason}: {example}")
    budget = cfg.packing.max_tokens
    if cfg.packing.mode == "packed":
        print(
            f"packs (epoch 0): {packs} of <= {budget} tokens, {tokens / max(1, packs):.0f} tokens per pack on average"
        )
        print(f"pack efficiency: {tokens / max(1, packs * budget):.2%} (real tokens / (packs x budget))")
    else:
        padded = totals["padded_tokens"]
        print(f"padded batches (epoch 0): {packs}; padding efficiency {tokens / max(1, padded):.2%}")
    print(f"tokens: {tokens} = text {text_tokens} + image {image_tokens} + video {video_tokens}")
    print(f"images: {totals['images']} ({totals['image_patches']} ViT patches)")
    print(
        f"videos: {totals['videos']} in {totals['video_samples']} samples ({totals['video_temporal_patches']} temporal "
        f"patches, {totals['frames']} listed frames, {totals['video_patches']} ViT patches)"
    )

    print()
    print("\n".join(fit_report(cfg, 1, "none", True, gpu_targets())))
    patches_per_pack = (totals["image_patches"] + totals["video_patches"]) / max(1, packs)
    print(f"  (this data: {patches_per_pack:.0f} ViT patches per pack on average)")

    steps = train_loader.steps(0)
    batch = next(iter(train_loader))
    rows = train_loader.fetch([item.key for item in next(steps)[0].items])
    print(f"\nfirst batch: { {k: tuple(v.shape) for k, v in batch.items() if hasattr(v, 'shape')} }")
    print(f"  max_seqlen={batch.get('max_seqlen')} labels={batch['num_label_tokens']} samples={len(rows)}")
    for row in rows[: args.examples]:
        text = describe_sample(
            processor.tokenizer,
            row["input_ids"],
            row["labels"],
            model_config.image_token_id,
            model_config.video_token_id,
        )
        grids = f"grids {row['image_grid_thw']}, video grids {row['video_grid_thw']}"
        print(f"\n--- sample {row['sample_id']} ({row['length']} tokens, {grids})\n{text}")


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:  # a recipe/override mistake: one line that says how to fix it, as train.py does
        sys.exit(f"config error: {error}")
    except DataError as error:
        sys.exit(f"data error: {error}")
