"""`make smoke-test`: from a fresh checkout to a trained tiny model, in one command.

1. Environment: uses the current Python when it has the requirements; otherwise creates `.venv` with
   `make install` and re-runs itself there.
2. Trains recipes/smoke.yaml with train.py — which generates the built-in dataset and the tiny processor on first
   use — on one GPU with the fused rope kernels; without a GPU, a smaller CPU run (transformers' rope: the Triton
   kernels would run in their interpreter, far slower than on a GPU).
3. Prints a summary (loss start → end, tokens/s, MFU, where the run, its export and its wandb files are) and fails
   unless the loss fell clearly.
4. Proves the model sees: answers HELD_OUT held-out built-in questions with the untrained and the trained model
   (scripts/generate.py) and prints exact match per question kind beside the answer prior (the most frequent training
   answer to the same question: what a model that ignores the pixels can reach, inference/builtin_eval.py); fails
   unless the trained model beats the prior by REQUIRED_MARGIN on the kinds that need the image, pooled.

Extra arguments are passed to train.py as overrides, e.g. `make smoke-test ARGS="train.max_steps=100"`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/smoke.yaml"
REQUIRED = {"torch": None, "transformers": "5.23.0", "accelerate": None, "datasets": None, "wandb": None, "yaml": None}
DISTRIBUTIONS = {"yaml": "pyyaml"}
# The question kinds of every smoke run: the image's background colour, which a vision path learns within the smoke
# budget, and a shape's colour, which it does not yet (docs/inference.md has the measurements).
SMOKE_OVERRIDES = ["data.builtin_kinds=[background,color]"]
CPU_OVERRIDES = [
    "train.output_dir=runs/smoke-cpu",
    "model.dtype=float32",
    "kernels.mrope=unfused",
    "data.num_samples=800",
    "data.max_pixels=25088",  # 32 LLM tokens an image at most: more samples a step for the same time
    "packing.max_tokens=1024",
    "train.max_steps=200",
    "train.lr=0.003",
    "train.eval_every=100",
    "checkpoint.every_steps=0",
]
REQUIRED_LOSS_DROP = 0.5  # the end loss must be below this fraction of the start loss
HELD_OUT = 120  # held-out built-in questions answered before and after training
ANSWER_TOKENS = 16  # the longest built-in answer is 12 tokens with the tiny tokenizer
# Exact-match points (0-1) by which the trained model must beat the answer prior on the image kinds, pooled; chosen
# from measurements (docs/inference.md): far above the prior's own spread between seeds, far below what the run
# reaches.
REQUIRED_MARGIN = 0.15


def missing_requirements() -> list[str]:
    """Requirement specs (pip syntax) the current interpreter lacks or has at another pinned version."""
    missing = []
    for module, version in REQUIRED.items():
        name = DISTRIBUTIONS.get(module, module)
        if importlib.util.find_spec(module) is None:
            missing.append(f"{name}=={version}" if version else name)
        elif version and importlib.metadata.version(name) != version:
            missing.append(f"{name}=={version}")
    return missing


def ensure_environment() -> None:
    missing = missing_requirements()
    if not missing:
        return
    venv_python = ROOT / ".venv" / "bin" / "python"
    if Path(sys.executable).resolve() == venv_python.resolve():
        sys.exit(f"[smoke] .venv lacks {missing}: delete .venv and run `make install`.")
    print(f"[smoke] {sys.executable} lacks {', '.join(missing)}: creating .venv with `make install`", flush=True)
    subprocess.run(["make", "-C", str(ROOT), "install"], check=True)
    os.chdir(ROOT)  # `-m scripts.smoke_test` resolves from the working directory
    os.execv(str(venv_python), [str(venv_python), "-m", "scripts.smoke_test", *sys.argv[1:]])


def main() -> int:
    ensure_environment()
    import torch

    on_gpu = torch.cuda.is_available()
    overrides = [*SMOKE_OVERRIDES, *([] if on_gpu else CPU_OVERRIDES)]
    overrides += sys.argv[1:]
    device = torch.cuda.get_device_name(0) if on_gpu else "CPU (no CUDA device: smaller run, transformers' rope)"
    print(f"[smoke] {device}: python train.py --config {RECIPE} {' '.join(overrides)}", flush=True)
    command = [sys.executable, "train.py", "--config", RECIPE, *overrides]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, check=False)
    train_wall = time.perf_counter() - started
    if result.returncode != 0:
        print(f"[smoke] FAILED: train.py exited with {result.returncode}", flush=True)
        return result.returncode

    from core.config import load_config
    from lifecycle import run_files

    run_dir = ROOT / load_config(str(ROOT / RECIPE), overrides).train.output_dir
    summary = run_files.read_summary(run_dir)
    start, end = summary["loss_start"], summary["loss_end"]
    mfu = "n/a (no GPU peak known)" if summary["mfu"] is None else f"{100 * summary['mfu']:.1f}%"
    rate = "n/a" if summary["tokens_per_s_per_gpu"] is None else f"{summary['tokens_per_s_per_gpu']:.0f}"
    eval_loss = "n/a" if summary["eval_loss"] is None else f"{summary['eval_loss']:.3f}"
    peak_mem = "n/a (CPU)" if summary["peak_mem_gib"] is None else f"{summary['peak_mem_gib']:.2f} GiB"
    lines = [
        f"loss            {start:.3f} → {end:.3f} over {summary['steps']} steps (held-out eval {eval_loss})",
        f"tokens/s/GPU    {rate} ({summary['timed_steps']} timed steps after warm-up), MFU {mfu}",
        f"rope kernels    {'fused (Triton)' if summary['fused_rope'] else 'transformers (unfused)'}",
        f"peak memory     {peak_mem}",
        f"run directory   {summary['run_dir']} (metrics.jsonl, summary.json, config.yaml, checkpoints/)",
        f"export          {summary['export_dir']}",
    ]
    generating = [r["gen_s"] for r in run_files.read_metrics(run_dir) if "gen_s" in r]
    if generating:
        share = f"{sum(generating):.1f} s of train.py's {train_wall:.0f} s ({sum(generating) / train_wall:.1%})"
        lines.append(f"generation eval {len(generating)} evaluations (train.generate_every): {share}")
    if summary["wandb_dir"]:
        lines.append(f"wandb files     {summary['wandb_dir']} (offline runs upload with `wandb sync <that dir>`)")
    print("\n[smoke] summary\n  " + "\n  ".join(lines), flush=True)
    if not end < REQUIRED_LOSS_DROP * start:
        print(f"[smoke] FAILED: the loss did not fall below {REQUIRED_LOSS_DROP:.0%} of its start.", flush=True)
        return 1
    sees, verdict = held_out_check(run_dir)
    if not sees:
        print(f"[smoke] FAILED: the trained model does not beat the answer prior: {verdict}", flush=True)
        return 1
    print(f"[smoke] OK: the model sees ({verdict})", flush=True)
    return 0


def held_out_check(run_dir: Path) -> tuple[bool, str]:
    """Answer the held-out built-in questions with the untrained and the trained model, print exact match per kind
    beside the answer prior's, write the table to `<run>/predictions/smoke-held-out.kinds.json` and judge
    (inference/builtin_eval.py)."""
    import json

    from inference import builtin_eval
    from scripts import generate

    out = run_dir / "predictions" / "smoke-held-out.jsonl"
    args = ["--run", str(run_dir), "--data", "builtin", "--num-samples", str(HELD_OUT), "--out", str(out)]
    args += ["--max-new-tokens", str(ANSWER_TOKENS), "--batch-size", "16", "--compare-init", "--overwrite"]
    print(f"[smoke] held-out check: python -m scripts.generate {' '.join(args)}", flush=True)
    if generate.main(args) != 0:
        return False, "generation stopped"
    report = builtin_eval.held_out_report(run_dir, out, REQUIRED_MARGIN)
    out.with_name(out.stem + ".kinds.json").write_text(json.dumps(report, indent=2) + "\n")
    print("[smoke] held-out exact match per question kind\n" + report["table"], flush=True)
    return report["sees"], report["verdict"]


if __name__ == "__main__":
    sys.exit(main())
