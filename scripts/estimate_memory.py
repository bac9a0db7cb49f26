"""A recipe's memory per GPU before it runs (trainer/memory_estimate.py), beside the GPU memory it targets; or the
estimate beside the measured peaks of benchmark result files.

    python -m scripts.estimate_memory --config recipes/qwen2_5_vl-7b.yaml [--gpus N] [--sharding fsdp2|ddp]
        [--gpu-memory-gib G] [--cpu] [dotted.key=value ...]
    python -m scripts.estimate_memory --compare docs/results/recipes-<date>.json [more.json ...] [--out FILE]
    python -m scripts.estimate_memory --calibration

The first form prints the breakdown, then whether it fits: the GPUs this machine sees, or `--gpu-memory-gib`, or
with neither an 80 GB H100 and a 141 GB H200; when it does not fit, the overrides that do (as train.py's refusal
names them). `--gpus N` estimates a launch of N processes, FSDP2 unless `--sharding ddp`; `--cpu` a
CPU-only run.

`--compare` reads result files with measured peaks (`peak_mem_gib`, torch.cuda.max_memory_allocated): a
recipes-<date>.json of scripts/bench_recipes.py (`recipes[name][variant]`, launched as its `launch` says) or a
compare_throughput JSON (`variants[name]`, one process unless it records a `launcher`). For every measured variant
it estimates the same recipe, overrides and launch (`auto` checkpointing resolved for the file's GPU, an 80 GB H100
unless its provenance names an H200), and prints measured / estimated (target: within TOLERANCE);
`--out` writes the comparison as a new JSON (result files are records of what ran: they are never edited), with
the provenance of the code that estimated.

`--calibration` prints measured / estimated for every point of the estimate's calibration
(trainer/memory_calibration.json: the peaks it was fitted to, each with its GPU, date and commit), flagging those
outside its target; tests/test_memory_calibration.py holds them there.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from core.config import load_config
from core.config_tree import ConfigError
from lifecycle import run_files
from trainer import activation_checkpointing
from trainer.memory_check import REFERENCE_GPUS, Target, fit_report, gpu_targets, local_target
from trainer.memory_estimate import CALIBRATION_FILE, estimate_memory
from verification.provenance import provenance
from verification.throughput_compare import VARIANT_OVERRIDES

TOLERANCE = 0.15  # the target: an estimate within 15% of the measured peak


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="recipe YAML")
    parser.add_argument("--gpus", type=int, default=1, help="processes of the launch (one GPU each)")
    parser.add_argument("--sharding", choices=("fsdp2", "ddp"), default="fsdp2", help="with --gpus > 1")
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="the GPU memory to fit (default: seen)")
    parser.add_argument("--cpu", action="store_true", help="a CPU-only run, against the RAM available")
    parser.add_argument("--compare", nargs="+", default=None, help="result JSONs with measured peak_mem_gib")
    parser.add_argument("--out", default=None, help="with --compare: write the comparison to this new JSON file")
    parser.add_argument(
        "--calibration", action="store_true", help="the calibration's measured peaks beside the estimate"
    )
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    if sum((args.config is not None, args.compare is not None, args.calibration)) != 1:
        parser.error("give one of --config (estimate a recipe), --compare (measured runs) or --calibration")
    if args.gpus < 1:
        parser.error("--gpus must be >= 1")
    return args


def targets(args) -> list[Target]:
    """What the estimate is held against (module docstring)."""
    if args.cpu:
        return [local_target(False, local_processes=args.gpus)]
    return gpu_targets(args.gpu_memory_gib)


def estimate_recipe(args) -> int:
    cfg = load_config(args.config, args.overrides)
    sharding = "none" if args.gpus == 1 else args.sharding
    lines = fit_report(cfg, args.gpus, sharding, not args.cpu, targets(args))
    print(f"{args.config} {' '.join(args.overrides)}".rstrip())
    print("\n".join(lines))
    return 0


def launch_processes(launch: str) -> tuple[int, str]:
    """(processes, sharding) of a bench_recipes `launch` command."""
    match = re.search(r"--num_processes[ =](\d+)", launch)
    processes = int(match.group(1)) if match else 1
    sharding = "fsdp2" if "fsdp2" in launch else "ddp" if processes > 1 else "none"
    return processes, sharding


def result_gpu(result: dict) -> Target:
    """The reference GPU a result file ran on: a 141 GB H200 when its provenance names an H200, else an 80 GB H100."""
    name = (result.get("provenance") or {}).get("gpu", {}).get("name", "")
    return REFERENCE_GPUS[1] if "H200" in name else REFERENCE_GPUS[0]


def measured_runs(result: dict) -> list[tuple[str, str, dict, list[str], str]]:
    """(row name, recipe, the variant's numbers, overrides, launch) of every measured variant in a result file."""
    runs = []
    if "recipes" in result:
        variant_keys = result.get("variants", {})
        for name, row in result["recipes"].items():
            for variant, numbers in row.items():
                if isinstance(numbers, dict) and numbers.get("peak_mem_gib") is not None:
                    extra = [
                        f"{k}={v}" for k, v in variant_keys.get(variant, VARIANT_OVERRIDES.get(variant, {})).items()
                    ]
                    runs.append(
                        (f"{name} {variant}", row["recipe"], numbers, [*row["overrides"], *extra], row["launch"])
                    )
    elif "variants" in result and "recipe" in result:
        for variant, numbers in result["variants"].items():
            if isinstance(numbers, dict) and numbers.get("peak_mem_gib") is not None:
                extra = [f"{k}={v}" for k, v in VARIANT_OVERRIDES.get(variant, {}).items()]
                runs.append(
                    (variant, result["recipe"], numbers, [*result["overrides"], *extra], result.get("launcher") or "")
                )
    return runs


def compare(paths: list[str], out: str | None) -> int:
    """Print measured / estimated for every measured run of `paths`, flagging those outside TOLERANCE; with `out`,
    write the rows to that file."""
    print(f"{'run':<48} {'measured GiB':>12} {'estimate GiB':>12} {'ratio':>6}")
    rows = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        print(path)
        for name, recipe, numbers, overrides, launch in measured_runs(result):
            processes, sharding = launch_processes(launch)
            try:
                cfg = load_config(recipe, overrides)
                gpu = result_gpu(result)
                cfg, _ = activation_checkpointing.resolve(cfg, processes, sharding, True, gpu.capacity_gib, gpu.name)
                estimate = estimate_memory(cfg, processes, sharding, True)
            except ConfigError as error:
                print(f"  {name:<46} not estimable: {error}")
                continue
            ratio = numbers["peak_mem_gib"] / estimate.peak_gib
            rows.append(
                {
                    "file": path,
                    "run": name,
                    "recipe": recipe,
                    "overrides": overrides,
                    "launch": launch,
                    "peak_mem_gib": numbers["peak_mem_gib"],
                    "memory_estimate_gib": round(estimate.peak_gib, 2),
                    "memory_ratio": round(ratio, 3),
                    "within_target": abs(ratio - 1) <= TOLERANCE,
                }
            )
            flag = "" if abs(ratio - 1) <= TOLERANCE else f"  outside the target (±{TOLERANCE:.0%})"
            print(f"  {name:<46} {numbers['peak_mem_gib']:12.1f} {estimate.peak_gib:12.1f} {ratio:6.2f}{flag}")
    if out:
        report = {"provenance": provenance(), "tolerance": TOLERANCE, "rows": rows}
        run_files.write_atomically(Path(out), json.dumps(report, indent=2) + "\n")
    return 0


def estimate_point(point: dict, model=None):
    """The estimate of a calibration point's recipe, overrides and launch (processes, sharding) on CUDA."""
    cfg = load_config(point["recipe"], point["overrides"])
    return estimate_memory(cfg, point["processes"], point["sharding"], True, model=model)


def within_target(ratio: float, target: dict) -> bool:
    return target["measured_over_estimate_min"] <= ratio <= target["measured_over_estimate_max"]


def calibration() -> int:
    """Print measured / estimated for every calibration point (module docstring)."""
    data = json.loads(CALIBRATION_FILE.read_text())
    print(f"{'run':<64} {'GPU':<22} {'date':<10} {'measured':>8} {'estimate':>8} {'ratio':>6}")
    for point in data["points"]:
        estimate = estimate_point(point)
        ratio = point["peak_gib"] / estimate.peak_gib
        flag = "" if within_target(ratio, data["target"]) else "  outside the target"
        if point.get("excluded"):
            flag = "  excluded: " + point["excluded"].split(";")[0]
        print(
            f"{point['run'][:64]:<64} {point['gpu'][:22]:<22} {point['date']:<10} {point['peak_gib']:8.1f} "
            f"{estimate.peak_gib:8.1f} {ratio:6.3f}{flag}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.calibration:
        return calibration()
    return compare(args.compare, args.out) if args.compare else estimate_recipe(args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as error:
        sys.exit(f"config error: {error}")
