r"""LoRA on one GPU against the same model's full fine-tune per GPU on N GPUs: tokens/s, MFU (the FLOP model's count
of what runs: trainer/metrics.py) and peak memory.

    python -m scripts.bench_lora --out docs/results/lora-h200-<date>.json [--models 7b,8b,9b] [--modes lora,full] \
        [--steps 25] [--warmup 10] [--full-gpus 2] [--launch-timeout 900] [dotted.key=value ...]

For each model, two launches of train.py of its shipped recipes at full depth and real width, random init from
the published architecture (recipes/models/; no download), on the recipes' built-in data (16k-token packs):
  lora   python train.py, one GPU: recipes/lora-<model>.yaml
  full   accelerate launch … fsdp2.yaml --num_processes N: recipes/<model>.yaml, N = --full-gpus
Each run takes --steps optimizer steps, the first --warmup untimed (compile, autotuning, allocator growth); no
checkpoints, no export. The dotted overrides go to every launch. Prints a table and writes every summary with its
launch command and the source's provenance (verification/provenance.py) as JSON to --out; an --out that exists keeps
its other runs, so separate calls (one model and mode each, within a machine's time limit) fill one file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lifecycle.run_files import read_summary
from verification.launch import free_port, log_tail, run_logged
from verification.provenance import provenance

# model -> (LoRA recipe, full fine-tune recipe)
RECIPES = {
    "7b": ("recipes/lora-qwen2_5_vl-7b.yaml", "recipes/qwen2_5_vl-7b.yaml"),
    "8b": ("recipes/lora-qwen3_vl-8b.yaml", "recipes/qwen3_vl-8b.yaml"),
    "9b": ("recipes/lora-qwen3_5-9b.yaml", "recipes/qwen3_5-9b.yaml"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="JSON file for the results")
    parser.add_argument("--models", default="7b,8b,9b", help=f"comma list of {sorted(RECIPES)}")
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of each run")
    parser.add_argument("--full-gpus", type=int, default=2, help="GPUs of the full fine-tune (fsdp2)")
    parser.add_argument("--modes", default="lora,full", help="comma list of lora, full")
    parser.add_argument("--launch-timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every launch, e.g. train.compile=true")
    return parser.parse_args(argv)


def launch_command(model: str, mode: str, run_dir: Path, args: argparse.Namespace) -> list[str]:
    lora_recipe, full_recipe = RECIPES[model]
    train_args = [
        "train.py",
        "--config",
        lora_recipe if mode == "lora" else full_recipe,
        f"train.output_dir={run_dir}",
        f"train.max_steps={args.steps}",
        "train.warmup_steps=5",
        "train.eval_every=0",
        f"logging.timing_warmup_steps={args.warmup}",
        "logging.report_to=none",
        "logging.progress_bar=false",
        "checkpoint.export=false",
        "checkpoint.save_final=false",
        "checkpoint.every_steps=0",
        *args.overrides,
    ]
    if mode == "lora":
        return [sys.executable, *train_args]
    launcher = ["-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/fsdp2.yaml"]
    launcher += [f"--num_processes={args.full_gpus}", f"--main_process_port={free_port()}"]
    return [sys.executable, *launcher, *train_args]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models, modes = args.models.split(","), args.modes.split(",")
    unknown = sorted(set(models) - set(RECIPES)) + sorted(set(modes) - {"lora", "full"})
    if unknown:
        print(f"unknown --models or --modes {unknown}: choose from {sorted(RECIPES)} and lora, full", file=sys.stderr)
        return 2
    runs_dir = args.out.with_suffix("")
    runs_dir.mkdir(parents=True, exist_ok=True)
    earlier = json.loads(args.out.read_text())["runs"] if args.out.is_file() else []
    rows = [row for row in earlier if (row["model"], row["mode"]) not in {(m, n) for m in models for n in modes}]
    failed = []
    for model in models:
        for mode in modes:
            run_dir = runs_dir / f"{model}-{mode}"
            command = launch_command(model, mode, run_dir, args)
            outcome = run_logged(command, runs_dir / f"{model}-{mode}.log", args.launch_timeout, new_session=True)
            row = {"model": model, "mode": mode, "gpus": 1 if mode == "lora" else args.full_gpus}
            row["command"] = command[1:]
            row["provenance"] = provenance()
            if outcome.code != 0:
                failed.append(f"{model}-{mode}")
                row["error"] = f"exit {outcome.code}: {log_tail(runs_dir / f'{model}-{mode}.log', 20)}"
            else:
                row["summary"] = read_summary(run_dir)
            rows.append(row)
            args.out.write_text(json.dumps({"runs": rows}, indent=2) + "\n")
    print(f"{'model':6} {'mode':5} {'gpus':>4} {'tokens/s/GPU':>12} {'MFU':>6} {'peak GiB':>8}")
    for row in rows:
        summary = row.get("summary") or {}
        mfu = summary.get("mfu")
        print(
            f"{row['model']:6} {row['mode']:5} {row['gpus']:>4} {summary.get('tokens_per_s_per_gpu') or 0:12.0f} "
            f"{'-' if mfu is None else f'{100 * mfu:5.1f}%':>6} {summary.get('peak_mem_gib') or 0:8.1f}"
        )
    for name in failed:
        print(f"FAILED {name}: see {runs_dir / (name + '.log')}", file=sys.stderr)
    return 1 if failed else 0
