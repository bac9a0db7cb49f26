"""Throughput comparison: the same recipe trained with the fused mRoPE kernels and with transformers' unfused rope
(optionally Liger-Kernel's rope, and padded instead of packed batches), one train.py process per variant.

    python scripts/compare_throughput.py --config recipes/bench-qwen2_5_vl-3b-shape.yaml --steps 40 \
        [--variants fused,unfused,padded] [--out artifacts/compare/NAME] [dotted.key=value ...]
    make compare CONFIG=recipes/... ARGS="--steps 40"

Honest by construction: every variant is a separate process with the same recipe, seed and data order (only the
variant's own keys differ); throughput and MFU are train.py's own means over the steps after
`logging.timing_warmup_steps`; tokens are real (non-pad) tokens. Each run logs to wandb in one group with its
variant as a tag (offline automatically without a login). Writes into --out: one run directory per variant,
`comparison.json` (every number below), `comparison.png` (tokens/s and loss per step) and `comparison.md` (the
table), and prints the table.

Variants (train.py overrides they set):
  fused    kernels.mrope=fused,   packing.mode=packed
  unfused  kernels.mrope=unfused, packing.mode=packed   (transformers' own rotary code)
  liger    kernels.mrope=unfused, packing.mode=packed, with Liger-Kernel's rope in transformers' place — only for
           Qwen2/2.5-VL and only when liger_kernel imports; otherwise it is left out with the reason printed
  padded   kernels.mrope=fused,   packing.mode=padded   (per-sample padded batches: the packing baseline)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.config import load_config  # noqa: E402
from training.config_tree import ConfigError  # noqa: E402
from training.distributed import SAFE_COLLECTIVES_ENV, kill_process_tree  # noqa: E402

VARIANT_OVERRIDES = {
    "fused": {"kernels.mrope": "fused", "packing.mode": "packed"},
    "unfused": {"kernels.mrope": "unfused", "packing.mode": "packed"},
    "liger": {"kernels.mrope": "unfused", "packing.mode": "packed"},
    "padded": {"kernels.mrope": "fused", "packing.mode": "padded"},
}
# Keys the script sets for every run; a user override of one of them would silently break the comparison.
RESERVED_KEYS = {
    "kernels.mrope",
    "packing.mode",
    "train.output_dir",
    "train.max_steps",
    "logging.group",
    "logging.tags",
    "logging.run_name",
    "logging.every_steps",
    "logging.timing_warmup_steps",
    "checkpoint.resume",
}
LIGER_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
# Runs train.py with Liger-Kernel's rope assigned to the module globals transformers' attention reads at call
# time (Liger's own monkey patch targets a name transformers 5.x no longer uses, so it would silently do nothing).
LIGER_BOOTSTRAP = """
import runpy, sys
import transformers.models.{family}.modeling_{family} as modeling
from liger_kernel.transformers.rope import liger_rotary_pos_emb, liger_rotary_pos_emb_vision
modeling.apply_rotary_pos_emb = liger_rotary_pos_emb
modeling.apply_rotary_pos_emb_vision = liger_rotary_pos_emb_vision
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


@dataclass
class RunResult:
    """What one variant's train.py run produced (read back from its run directory)."""

    variant: str
    run_dir: Path
    summary: dict
    records: list[dict]  # metrics.jsonl training records (those with a loss), one per logged step
    wall_s: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/smoke.yaml")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the recipe's)")
    parser.add_argument("--warmup", type=int, default=None, help="steps excluded from timing (default: the recipe's)")
    parser.add_argument("--variants", default="fused,unfused", help="comma list of: " + ", ".join(VARIANT_OVERRIDES))
    parser.add_argument(
        "--baseline", default=None, help="variant the ratios divide by (default: unfused, else the first)"
    )
    parser.add_argument("--out", default=None, help="output directory (default: artifacts/compare/<recipe name>)")
    parser.add_argument("--group", default=None, help="wandb group (default: compare-<recipe>-<UTC time>)")
    parser.add_argument(
        "--launcher",
        default=None,
        help="command that runs train.py instead of this Python, e.g. "
        "'accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 2'",
    )
    parser.add_argument("--run-timeout", type=int, default=3600, help="seconds one variant's run may take")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides applied to every variant")
    return parser.parse_args(argv)


def override_key(item: str) -> str:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form dotted.key=value (e.g. train.max_steps=100).")
    return item.split("=", 1)[0].strip()


def select_variants(requested: str, model_type: str, launcher: str | None) -> tuple[list[str], dict[str, str]]:
    """The variants to run, in the requested order, and {variant: reason} for those left out (liger only)."""
    names = [v.strip() for v in requested.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANT_OVERRIDES]
    if unknown or not names:
        raise ConfigError(f"--variants {requested!r}: unknown {unknown}; choose from {', '.join(VARIANT_OVERRIDES)}.")
    if len(set(names)) != len(names):
        raise ConfigError(f"--variants {requested!r} names a variant twice.")
    left_out = {}
    if "liger" in names:
        if model_type not in LIGER_FAMILIES:
            left_out["liger"] = f"Liger-Kernel has no rope for {model_type} (only {', '.join(LIGER_FAMILIES)})"
        elif importlib.util.find_spec("liger_kernel") is None:
            left_out["liger"] = "liger_kernel is not installed (pip install liger-kernel)"
        elif launcher is not None:
            left_out["liger"] = "the liger variant runs only without --launcher (one process)"
    kept = [v for v in names if v not in left_out]
    if len(kept) < 2:
        raise ConfigError(f"need at least two variants to compare, have {kept} (left out: {left_out}).")
    return kept, left_out


def train_command(variant: str, model_type: str, launcher: str | None) -> list[str]:
    if variant == "liger":
        return [sys.executable, "-c", LIGER_BOOTSTRAP.format(family=model_type)]
    prefix = shlex.split(launcher) if launcher else [sys.executable]
    return [*prefix, "train.py"]


def run_variant(
    variant: str,
    args: argparse.Namespace,
    model_type: str,
    out_dir: Path,
    group: str,
    steps: int,
    warmup: int,
) -> RunResult:
    """Train one variant in its own process; its console output goes to `<out>/<variant>/train.log`."""
    run_dir = out_dir / variant
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "summary.json"):  # a rerun into the same --out must not read old numbers
        (run_dir / stale).unlink(missing_ok=True)
    overrides = [
        *args.overrides,
        *(f"{k}={v}" for k, v in VARIANT_OVERRIDES[variant].items()),
        f"train.output_dir={run_dir}",
        f"train.max_steps={steps}",
        f"logging.timing_warmup_steps={warmup}",
        "logging.every_steps=1",  # per-step loss and throughput curves; one sync per step, the same in every run
        f"logging.group={group}",
        f"logging.tags=[{variant}, compare]",
        f"logging.run_name={group}-{variant}",
        "checkpoint.resume=null",
    ]
    command = [*train_command(variant, model_type, args.launcher), "--config", args.config, *overrides]
    print(f"[compare] {variant}: {shlex.join(command)}", flush=True)
    env = {**os.environ, **SAFE_COLLECTIVES_ENV}
    log_path = run_dir / "train.log"
    start = time.perf_counter()
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            kill_process_tree(proc.pid)
            proc.wait()
            code = f"killed after --run-timeout {args.run_timeout} s"
    wall = time.perf_counter() - start
    if code != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"variant {variant} failed ({code}); end of {log_path}:\n{tail}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if "loss" in r]
    print(f"[compare] {variant}: done in {wall:.0f} s, {summary['tokens_per_s_per_gpu'] or 0:.0f} tokens/s/GPU")
    return RunResult(variant, run_dir, summary, records, wall)


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def max_abs_loss_gap(a: RunResult, b: RunResult) -> float | None:
    """max over the steps both runs logged of |loss_a - loss_b| (None when they share no step)."""
    loss_b = {r["step"]: r["loss"] for r in b.records}
    gaps = [abs(r["loss"] - loss_b[r["step"]]) for r in a.records if r["step"] in loss_b]
    return max(gaps) if gaps else None


def same_data(a: RunResult, b: RunResult) -> bool:
    """Whether two runs saw the same batches: identical per-step pack efficiency (real tokens / budget) at every
    step, which differs as soon as one step's batch does."""
    return [r["pack_efficiency"] for r in a.records] == [r["pack_efficiency"] for r in b.records]


def variant_numbers(result: RunResult, warmup: int) -> dict:
    """One row of the table: means over the timed steps (after warm-up) from train.py's own accounting."""
    timed = [r for r in result.records if r["step"] > warmup]
    summary = result.summary
    return {
        "tokens_per_s_per_gpu": summary["tokens_per_s_per_gpu"],
        "step_time_s": _mean([r["step_time_s"] for r in timed]),
        "mfu": summary["mfu"],
        "peak_mem_gib": summary["peak_mem_gib"],
        "loss_end": summary["loss_end"],
        "pack_efficiency": _mean([r["pack_efficiency"] for r in timed]),
        "timed_steps": summary["timed_steps"],
        "fused_rope": summary["fused_rope"],
        "run_dir": str(result.run_dir),
        "wandb_dir": summary.get("wandb_dir"),
        "wall_s": result.wall_s,
    }


def compare(results: list[RunResult], baseline: str, warmup: int) -> dict:
    """Rows per variant with ratios to `baseline`; |Δloss| and same-data checks against the baseline's packing mode
    peer (padded runs see different batches, so their losses are compared only with each other)."""
    by_name = {r.variant: r for r in results}
    base = by_name[baseline]
    rows = {r.variant: variant_numbers(r, warmup) for r in results}
    base_row = rows[baseline]
    for name, row in rows.items():
        for key in ("tokens_per_s_per_gpu", "step_time_s", "mfu"):
            ours, theirs = row[key], base_row[key]
            row[f"{key}_ratio"] = ours / theirs if ours is not None and theirs else None
        peer = base if (name == "padded") == (baseline == "padded") else None
        row["max_abs_dloss_vs_baseline"] = None if peer is None else max_abs_loss_gap(by_name[name], peer)
        row["same_data_as_baseline"] = None if peer is None else same_data(by_name[name], peer)
    named = {}
    if "fused" in rows and "unfused" in rows:
        named["fused/unfused tokens/s"] = _ratio(rows["fused"], rows["unfused"])
        named["fused vs unfused max |dloss|"] = max_abs_loss_gap(by_name["fused"], by_name["unfused"])
    if "fused" in rows and "padded" in rows:
        named["packed/padded tokens/s"] = _ratio(rows["fused"], rows["padded"])
    if "fused" in rows and "liger" in rows:
        named["fused/liger tokens/s"] = _ratio(rows["fused"], rows["liger"])
    return {"baseline": baseline, "variants": rows, "ratios": named}


def _ratio(a: dict, b: dict) -> float | None:
    x, y = a["tokens_per_s_per_gpu"], b["tokens_per_s_per_gpu"]
    return x / y if x is not None and y else None


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(comparison: dict) -> str:
    """The side-by-side table as Markdown (it pastes into the README as is)."""
    baseline = comparison["baseline"]
    lines = [
        f"| variant | tokens/s/GPU | × {baseline} | step time (s) | MFU | peak mem (GiB) | final loss "
        f"| max \\|Δloss\\| vs {baseline} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in comparison["variants"].items():
        mfu = None if row["mfu"] is None else 100 * row["mfu"]
        gap = row["max_abs_dloss_vs_baseline"]
        gap_text = "other batches" if gap is None and name != baseline else _fmt(gap, ".2e")
        lines.append(
            f"| {name} | {_fmt(row['tokens_per_s_per_gpu'], ',.0f')} "
            f"| {_fmt(row['tokens_per_s_per_gpu_ratio'], '.3f')} "
            f"| {_fmt(row['step_time_s'], '.3f')} | {_fmt(mfu, '.1f')}{'%' if mfu is not None else ''} "
            f"| {_fmt(row['peak_mem_gib'], '.1f')} | {_fmt(row['loss_end'], '.4f')} | {gap_text} |"
        )
    return "\n".join(lines)


def plot(results: list[RunResult], warmup: int, title: str, path: Path) -> None:
    """tokens/s per GPU and loss against the step, one line per variant; the warm-up steps shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.5))
    for result in results:
        steps = [r["step"] for r in result.records]
        ax_speed.plot(steps, [r["tokens_per_s_per_gpu"] for r in result.records], label=result.variant)
        ax_loss.plot(steps, [r["loss"] for r in result.records], label=result.variant)
    for ax, ylabel in ((ax_speed, "tokens/s per GPU"), (ax_loss, "training loss")):
        if warmup:
            ax.axvspan(0.5, warmup + 0.5, color="0.9", label="warm-up (not timed)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment() -> dict:
    """Where the numbers come from: device, library versions, commit, date."""
    import torch
    import transformers

    return {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.machine()})",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": git_commit(),
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
    }


def git_commit() -> str:
    """Short commit of the checkout, '-dirty' with uncommitted changes; 'unknown' without git or a repository."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    except FileNotFoundError:
        return "unknown"
    if commit.returncode != 0:
        return "unknown"
    return commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    clashes = sorted({override_key(o) for o in args.overrides} & RESERVED_KEYS)
    if clashes:
        raise ConfigError(f"{clashes} are set by the comparison itself; use --steps/--warmup/--variants/--group.")
    cfg = load_config(args.config, args.overrides)  # validates the recipe and overrides before any run starts
    model_type = (cfg.model.config or {}).get("model_type") or _checkpoint_model_type(cfg.model.name_or_path)
    variants, left_out = select_variants(args.variants, model_type, args.launcher)
    for name, reason in left_out.items():
        print(f"[compare] variant {name} left out: {reason}", flush=True)
    baseline = args.baseline or ("unfused" if "unfused" in variants else variants[0])
    if baseline not in variants:
        raise ConfigError(f"--baseline {baseline} is not among the variants run ({', '.join(variants)}).")
    steps = args.steps or cfg.train.max_steps
    warmup = cfg.logging.timing_warmup_steps if args.warmup is None else args.warmup
    if steps <= warmup:
        raise ConfigError(f"--steps {steps} must exceed the {warmup} warm-up steps (set --warmup or --steps).")
    recipe = Path(args.config).stem
    out_dir = Path(args.out or f"artifacts/compare/{recipe}").resolve()
    group = args.group or f"compare-{recipe}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
    env_info = environment()
    print(f"[compare] {recipe}: {', '.join(variants)}; {steps} steps, {warmup} warm-up; wandb group {group}")

    results = [run_variant(v, args, model_type, out_dir, group, steps, warmup) for v in variants]
    comparison = compare(results, baseline, warmup)
    report = {
        "recipe": args.config,
        "overrides": args.overrides,
        "steps": steps,
        "warmup_steps": warmup,
        "wandb_group": group,
        "left_out": left_out,
        "environment": env_info,
        **comparison,
        "curves": {r.variant: r.records for r in results},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "comparison.json").write_text(json.dumps(report, indent=2) + "\n")
    title = f"{recipe} — {env_info['device']}, {env_info['date_utc']} UTC, commit {env_info['commit']}"
    plot(results, warmup, title, out_dir / "comparison.png")
    text = table(comparison)
    ratios = "\n".join(f"- {k}: {_fmt(v, '.4g')}" for k, v in comparison["ratios"].items())
    (out_dir / "comparison.md").write_text(f"{title}\n\n{text}\n\n{ratios}\n")
    print(f"\n{title}\n\n{text}\n\n{ratios}\n")
    print(f"[compare] wrote {out_dir}/comparison.{{json,png,md}}")
    return report


def _checkpoint_model_type(name_or_path: str) -> str:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name_or_path).model_type


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, RuntimeError) as error:
        sys.exit(f"[compare] error: {error}")
