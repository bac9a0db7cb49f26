"""Load, process and pack a recipe's data, and print what happened.

    python -m scripts.inspect_data --config recipes/tiny-qwen2_5_vl.yaml [dotted.key=value ...]

Prints samples kept/skipped (count per reason, first examples), packs and pack efficiency (real tokens / budget),
text vs image vs video tokens, image and video counts, ViT patches, the memory estimate per GPU for one process beside
the GPU memory it targets (scripts/estimate_memory.py), and a few decoded samples with the label mask: trained
(assistant) tokens in [[...]]. A mixture (data.sources) adds a line per source (records, kept, skipped, kept training
tokens) and the realised mixture: each source's samples and tokens in epoch 0's plan against its weight.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time

from core.config import load_config
from core.config_tree import ConfigError
from core.data_config import source_names
from core.families import hf_config
from data.formats import DataError
from data.pipeline import build_data, load_processor
from data.processing import IGNORE_INDEX
from trainer.memory_check import fit_report, gpu_targets
from verification.plan_totals import epoch_totals


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


def mixture_lines(sources, stats, totals: dict) -> list[str]:
    """Per source: its records, kept and skipped samples and kept training tokens, then its weight's share against
    its share of epoch 0's planned samples and tokens (the realised mixture)."""
    weight_sum = sum(source.weight for source in sources)
    samples, tokens = sum(totals["source_samples"]), sum(totals["source_tokens"])
    lines = ["sources (kept training tokens; weight share -> epoch 0's share of samples, of tokens):"]
    for index, (source, name) in enumerate(zip(sources, source_names(sources), strict=True)):
        source_stats = stats.sources[name]
        lines.append(
            f"  {name} ({source.path}): {source_stats.summary()} tokens={source_stats.train_tokens}; "
            f"weight {source.weight:g} = {source.weight / weight_sum:.1%} -> samples "
            f"{totals['source_samples'][index]} = {totals['source_samples'][index] / max(1, samples):.1%}, tokens "
            f"{totals['source_tokens'][index]} = {totals['source_tokens'][index] / max(1, tokens):.1%}"
        )
    return lines


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
    where = f"data.sources: {len(cfg.data.sources)}" if cfg.data.sources else f"data.path={cfg.data.path or 'builtin'}"
    print(f"{where} streaming={cfg.data.streaming} (built in {built:.1f}s, cached after a first run)")
    print(f"samples: {stats.summary()}")
    if stats.placeholders_note():
        print(stats.placeholders_note().removeprefix("data: "))
    for reason, examples in stats.skip_examples.items():
        for example in examples:
            print(f"  skipped {reason}: {example}")
    if cfg.data.sources:
        print("\n".join(mixture_lines(cfg.data.sources, stats, totals)))
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
