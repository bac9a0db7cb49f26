"""Check that a recipe's packed batches train exactly like their samples one by one.

Builds the recipe's model (tiny or a checkpoint), takes a few packs from the recipe's data pipeline, and for each
runs forward+backward packed (modeling/packed.py) and per sample (transformers' own path, positions from the model
itself; the built-in data holds images and videos, data.video_share); prints the pack's video count and max |Δ|
of logits, loss and the worst parameter gradient, with unfused and fused rope. Exits 1 when any quantity is
beyond tolerance (relative to its own magnitude: fp32 summation noise, bf16/fp16 rounding).
bf16/fp16 models also run both sides on an fp32 copy: its packed vs per-sample difference (column "fp32 copy", the
worst relative one) must stay within the fp32 tolerance, and each low-precision gradient may differ by up to
3x the larger of the two runs' own errors against that copy (verification/packing_check.py says why).
The recipe's packing.mode is forced to "packed"; everything else (model, dtype, data, pack budget) is the recipe's.
A LoRA recipe's adapters are applied with their B drawn at random (peft's zero init would make them change nothing),
and the comparison covers their gradients, the only ones then.
MoE models: the packed run takes the per-sample run's top-k expert choices (pinned, verification/routing_pin.py), so a
near-tie token rounded onto another expert cannot pass for a leak; each pack prints how many choices would flip.

    python -m scripts.verify_packing --config recipes/tiny-qwen3_5.yaml [--packs 3] [dotted.key=value ...]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from core.config import load_config
from data.pipeline import build_data, load_processor
from modeling.build import build_model
from modeling.lora import apply_lora
from modeling.packed import enable_packed_forward
from verification.packing_check import (
    RELATIVE_TOLERANCE,
    ROUNDING_FACTOR,
    compare_packed_to_per_sample,
    randomize_adapters,
    samples_from_batch,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/tiny-qwen2_5_vl.yaml")
    parser.add_argument("--packs", type=int, default=3, help="how many packs of the recipe's data to check")
    parser.add_argument("--rope", choices=("both", "unfused", "fused"), default="both")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rtol", type=float, default=None, help="override the dtype's relative tolerance")
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. packing.max_tokens=2048")
    return parser.parse_args(argv)


def to_device(batch: dict, device: str, dtype: torch.dtype) -> dict:
    """Tensors of `batch` on `device`; pixel values in the model's dtype (second_per_grid_ts keeps its float64:
    the reference derives positions from it)."""
    return {
        key: value.to(device, dtype if key.startswith("pixel_values") else None) if torch.is_tensor(value) else value
        for key, value in batch.items()
    }


def rope_variants(choice: str) -> list[str]:
    return ["unfused", "fused"] if choice == "both" else [choice]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, [*args.overrides, "packing.mode=packed"])
    model = build_model(cfg.model, attn_implementation="sdpa").to(args.device)
    model.train()
    enable_packed_forward(model, cfg.kernels.gated_delta)
    if cfg.lora is not None:  # the recipe's adapters, drawn at random so that they change the outputs
        apply_lora(model, cfg.lora, model.dtype)
        randomize_adapters(model)
    rtol = args.rtol if args.rtol is not None else RELATIVE_TOLERANCE[model.dtype]
    merge = model.config.vision_config.spatial_merge_size

    train_loader, _, stats = build_data(
        cfg.data,
        cfg.packing,
        load_processor(cfg.model, cfg.data),
        model.config,
        grad_accum_steps=cfg.train.grad_accum_steps,
    )
    batches = [to_device(b, args.device, model.dtype) for b in itertools.islice(train_loader, args.packs)]
    if not batches:
        print(f"no packs from the recipe's data ({stats.summary()})", file=sys.stderr)
        return 2

    low_precision = model.dtype != torch.float32
    exact_rtol = RELATIVE_TOLERANCE[torch.float32]
    rounding = f", or {ROUNDING_FACTOR:g}x the runs' error vs an fp32 copy (fp32 copy: {exact_rtol:g})"
    rounding = rounding if low_precision else ""
    header = f"{model.config.model_type} ({model.dtype}, {args.device}); max |Δ| packed vs per-sample"
    print(f"{header}; tolerance {rtol:g} relative{rounding}")
    exact_column = f" {'fp32 copy':>9}" if low_precision else ""
    print(
        f"{'rope':8} {'pack':>4} {'samples':>7} {'videos':>6} {'tokens':>6}  {'logits':>9} {'loss':>9} {'grad':>9}"
        f"{exact_column}  "
        "worst gradient"
    )
    failures = []
    for rope in rope_variants(args.rope):
        if rope == "fused":
            from mrope_kernels.patch import patch_model, unpatch_model

            patch_model(model)
        for index, batch in enumerate(batches):
            report = compare_packed_to_per_sample(model, samples_from_batch(batch, merge), batch=batch)
            worst = report.worst_grad
            exact, allowed = "", ""
            if report.exact:
                exact = f" {max(d.relative for d in report.exact):9.1e}"
                allowed = f", {ROUNDING_FACTOR:g}x rounding {ROUNDING_FACTOR * worst.rounding:.1e}"
            videos = 0 if batch.get("video_grid_thw") is None else batch["video_grid_thw"].shape[0]
            print(
                f"{rope:8} {index:>4} {len(batch['sample_lengths']):>7} {videos:>6} {batch['input_ids'].shape[1]:>6}  "
                f"{report.logits.max_abs:9.2e} {report.loss.max_abs:9.2e} {worst.max_abs:9.2e}{exact}  "
                f"{worst.name} (rel {worst.relative:.1e}{allowed})"
            )
            if report.routing_choices:
                print(
                    f"{'':8} routing: {report.routing_flips} of {report.routing_choices} token choices would flip "
                    "(pinned)"
                )
            failures += [f"{rope} pack {index}: {msg}" for msg in report.failures(rtol)]
        if rope == "fused":
            unpatch_model(model)
    for message in failures:
        print(f"FAIL {message}", file=sys.stderr)
    print("PASS" if not failures else f"FAIL: {len(failures)} quantities beyond tolerance")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
