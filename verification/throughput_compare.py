"""Throughput comparison: the same recipe trained with the fused mRoPE kernels and with transformers' unfused rope
(optionally Liger-Kernel's rope, and padded instead of packed batches), one train.py process per run, every variant
repeated with the variants alternating (A B A B ...), so drift of the machine hits all of them alike.

    python -m scripts.compare_throughput --config recipes/bench-qwen2_5_vl-3b-shape.yaml --steps 14 --warmup 5 \
        [--repeats 3] [--variants fused,unfused,liger] [--heldout-samples 64] [--out artifacts/compare/NAME] \
        [dotted.key=value ...]
    make compare CONFIG=recipes/... ARGS="--steps 40"

Honest by construction: every run is a separate process with the same recipe, seed and data order (only the
variant's own keys differ); throughput and MFU are train.py's own means over the steps after
`logging.timing_warmup_steps`; tokens are real (non-pad) tokens. Runs log at the recipe's `logging.every_steps` (one
device sync per interval, as training does; the loss curve still has every step). A variant's number is the median
over its repeats, with the spread (min-max) beside it; a ratio is the ratio of medians, with the range
min(A)/max(B) .. max(A)/min(B) that the repeats allow. Each run logs to wandb in one group with its variant as a tag
(offline automatically without a login). Writes into --out: one run directory per run (`<variant>/run<i>`),
`comparison.json`, `comparison.png` (tokens/s per logged step and loss per step, each variant's first finished run)
and `comparison.md` (the table), and prints the table. The JSON and the table are rewritten after every full round
of variants, so a session cut short keeps the rounds it finished. A run that fails (or is killed at --run-timeout,
after printing its stacks into its train.log) is listed under `failed` and the comparison goes on with the others;
the script then exits non-zero.

Held-out accuracy beside throughput: with --heldout-samples N (default 0: off, timing runs are unchanged) every run
also answers the first N records of its held-out split (data.eval_fraction > 0; train.generate_every=<steps>,
train.generate_samples=N: one greedy evaluation, after its last step; docs/inference.md) and its row reports that
evaluation's scores, exact match overall and per question kind, as the median over the repeats with min-max. The
evaluation does not fall inside the throughput: train.py pauses its step clocks (after a device sync) around every
evaluation (trainer/metrics.py, MetricsLogger.paused), so tokens/s, step time and MFU cover the timed training steps
only, and the GPU-busy samples stop at the last logged step; only `wall_s` includes it. A recipe that evaluates on its
own (train.generate_every) without the flag gets its last evaluation reported the same way. `ratios` names the gap
(a - b) of each pair's held-out exact match, e.g. "fused vs unfused held-out exact match" and "packed vs padded
held-out exact match", beside each variant's spread over its repeats: same weights up to rounding answer alike, so
the gap should sit within that spread (with N answers one answer moves exact match by 1/N).

Is the host the bottleneck? While a run trains, NVML's GPU utilisation of the run's GPU (the share of each ~0.2-1 s
window in which any kernel ran) is sampled every 0.1 s and tagged with the last step the run has logged; the mean of
the samples taken during the timed steps is the run's `gpu_busy` fraction (null without NVML or a GPU). A run whose
`gpu_busy` is under HOST_BOUND_THRESHOLD is flagged `host_bound`: its GPU sat idle for more than that share of the
timed steps, waiting on the host (Python, launches, data) or on a sync, so its tokens/s measures the host as much as
the GPU (a shared or slow host CPU moves it). A GPU-bound training step measures 0.95-1.0.

comparison.json:
  recipe, overrides, steps, warmup_steps, repeats, run_order ([variant, repeat] in the order run), wandb_group,
  left_out {variant: reason}, environment (verification/provenance.py: commit or source digest, GPU, library
  versions, date), host_bound_threshold,
  failed [{variant, repeat, error}], baseline, variants {name: {
      tokens_per_s_per_gpu, step_time_s, mfu: medians over the repeats; tokens_per_s_min, tokens_per_s_max,
      tokens_per_s_spread (max-min over median); <key>_ratio for those three (ratio of medians to the baseline);
      gpu_busy (median over runs), host_bound (any run flagged); peak_mem_gib, loss_end, pack_efficiency,
      timed_steps, fused_rope (first finished run); max_abs_dloss_vs_baseline, same_data_as_baseline (first runs,
      null for a padded run against a packed baseline); max_abs_dloss_repeats (the largest |Δloss| of a later
      repeat against the variant's first run: the run-to-run noise a gap between variants is read against, null
      with one run); heldout (null without an evaluation: {step, runs, and per score of metrics.jsonl's gen_* record,
      the prefix dropped: exact_match, relaxed_accuracy, anls, rouge_l, bleu, exact_match/<kind>: {median, min,
      max}}); dloss_repeat_pairs and dloss_vs_baseline_pairs ({median, max, pairs} of the max |Δloss| of
      every pair of its repeats, and of every pair of one of its runs and one of the baseline's; null without a
      pair); runs [{repeat, tokens_per_s_per_gpu, step_time_s, mfu,
      gpu_busy, host_bound, run_dir, wandb_dir, wall_s, losses ([step, loss] of every step it logged: any pair's
      gap recomputes from the JSON alone), heldout ({step, exact_match, ...} of its last evaluation or null)}]}},
  ratios {"fused/unfused tokens/s" etc.: {median, min, max}, "fused vs unfused max |dloss|": float,
      "fused repeats max |dloss|" and "unfused repeats max |dloss|": float or null (their noise),
      "fused vs unfused |dloss|, every pair", "fused repeats |dloss|, every pair" and the unfused one:
      {median, max, pairs} or null: the gap between variants and the noise over every pair, not one draw;
      "<a> vs <b> held-out exact match" (HELDOUT_PAIRS, when both evaluated): {gap, min, max (the range the repeats
      allow), spread_a, spread_b (max-min of each variant's repeats), within_repeat_spread, by_kind {kind: gap}}},
  curves {variant: metrics.jsonl training records of its first finished run}

Variants (train.py overrides they set):
  fused    kernels.mrope=fused,   packing.mode=packed
  unfused  kernels.mrope=unfused, packing.mode=packed   (transformers' own rotary code)
  liger    kernels.mrope=unfused, packing.mode=packed, with Liger-Kernel's rope in transformers' place — only for
           Qwen2/2.5-VL and only when liger_kernel imports; otherwise it is left out with the reason printed
  padded   kernels.mrope=fused,   packing.mode=padded   (per-sample padded batches: the packing baseline)
  bf16-weights  kernels.mrope=fused, packing.mode=packed, train.master_weights=optimizer (the module computes on
           bf16 matmul weights, the optimizer steps their fp32 masters; compare with --variants fused,bf16-weights
           --baseline fused) — only without --launcher: DDP refuses it and FSDP2 already computes on bf16 weights
  compiled  kernels.mrope=fused, packing.mode=packed, train.compile=true (regional torch.compile; the compile
           falls in the first, untimed step)
  bf16-compiled  bf16-weights and compiled together, the fastest measured setup on one GPU — only without
           --launcher, as bf16-weights
  shipped  nothing: the recipe as it ships, its `auto` settings resolved for the machine (trainer/defaults.py)
  shipped-unfused  kernels.mrope=unfused and nothing else: as shipped with transformers' rope, which the compiled
           blocks then compile too; beside `shipped`, what the fused kernels buy a user who launches the recipe
           (`make compare VARIANTS=shipped,shipped-unfused`)
  eager-fp32  train.compile=false, kernels.patch_embed=conv, train.master_weights=module, data.num_workers=2: eager
           fp32 module weights, the baseline the shipped defaults are measured against
  shipped-full-checkpointing  model.gradient_checkpointing_llm=true, model.gradient_checkpointing_vision=true
           and nothing else: as shipped with every decoder layer and ViT block recomputed, the recipes' setting
           before `auto` (beside `shipped`: what sizing the checkpointing to the GPU buys; a LoRA recipe's frozen ViT
           needs no gradient, so its flag changes nothing there)
  Every variant but bf16-weights, bf16-compiled and the shipped ones sets train.master_weights=module; every one but
  compiled, bf16-compiled and the shipped ones runs eager with transformers' Conv3d patch embedding.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import shlex
import statistics
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from core.config import load_config
from core.config_tree import ConfigError
from core.families import FAMILIES, hf_config
from lifecycle import run_files
from verification.launch import log_tail, run_logged
from verification.provenance import provenance

FP32_MODULE = {"train.master_weights": "module"}
EAGER = {"train.compile": "false", "kernels.patch_embed": "conv"}
COMPILED = {"train.compile": "true", "kernels.patch_embed": "matmul"}
VARIANT_OVERRIDES = {
    "fused": {"kernels.mrope": "fused", "packing.mode": "packed", **EAGER, **FP32_MODULE},
    "unfused": {"kernels.mrope": "unfused", "packing.mode": "packed", **EAGER, **FP32_MODULE},
    "liger": {"kernels.mrope": "unfused", "packing.mode": "packed", **EAGER, **FP32_MODULE},
    "padded": {"kernels.mrope": "fused", "packing.mode": "padded", **EAGER, **FP32_MODULE},
    "bf16-weights": {"kernels.mrope": "fused", "packing.mode": "packed", **EAGER, "train.master_weights": "optimizer"},
    "compiled": {"kernels.mrope": "fused", "packing.mode": "packed", **COMPILED, **FP32_MODULE},
    "bf16-compiled": {
        "kernels.mrope": "fused",
        "packing.mode": "packed",
        **COMPILED,
        "train.master_weights": "optimizer",
    },
    "shipped": {},
    "shipped-unfused": {"kernels.mrope": "unfused"},
    "eager-fp32": {**EAGER, **FP32_MODULE, "data.num_workers": "2"},
    "shipped-full-checkpointing": {
        "model.gradient_checkpointing_llm": "true",
        "model.gradient_checkpointing_vision": "true",
    },
}
# Keys the script sets for every run; a user override of one of them would silently break the comparison.
RESERVED_KEYS = {
    "kernels.mrope",
    "packing.mode",
    "train.master_weights",
    "train.compile",
    "kernels.patch_embed",
    "data.num_workers",
    "train.output_dir",
    "train.max_steps",
    "logging.group",
    "logging.tags",
    "logging.run_name",
    "logging.timing_warmup_steps",
    "checkpoint.resume",
}
HELDOUT_KEYS = {"train.generate_every", "train.generate_samples"}  # reserved too with --heldout-samples
LIGER_FAMILIES = tuple(t for t, family in FAMILIES.items() if family.liger_rope)
HOST_BOUND_THRESHOLD = 0.85  # gpu_busy under this flags a run as host-bound (module docstring)
BUSY_SAMPLE_S = 0.1
# (label, a, b): the variant pairs whose held-out exact match gap (a - b) `ratios` names when both evaluated.
HELDOUT_PAIRS = (
    ("fused vs unfused", "fused", "unfused"),
    ("packed vs padded", "fused", "padded"),
    ("shipped fused vs unfused", "shipped", "shipped-unfused"),
    ("compiled vs fused", "compiled", "fused"),
    ("bf16-weights vs fused", "bf16-weights", "fused"),
    ("fused vs liger", "fused", "liger"),
)
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
    repeat: int  # 1-based
    run_dir: Path
    summary: dict
    records: list[dict]  # metrics.jsonl training records (those with a loss), one per step
    wall_s: float
    busy_samples: list[tuple[int, float]] = field(default_factory=list)  # (last logged step, GPU utilisation 0-1)
    heldout: dict | None = None  # its last held-out evaluation: {"step", "exact_match", "exact_match/<kind>", ...}


class BusySampler:
    """Samples NVML's utilisation of the GPU a child run uses, each sample tagged with the last step the run has
    written to its metrics.jsonl (module docstring). Without NVML or a GPU it collects nothing."""

    def __init__(self, metrics_path: Path):
        self.metrics_path = metrics_path
        self.samples: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> BusySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(_visible_gpu_index())
        except Exception:  # no NVML library or no GPU: the run reports gpu_busy null
            return
        while not self._stop.wait(BUSY_SAMPLE_S):
            step = last_logged_step(self.metrics_path)
            if step is not None:
                self.samples.append((step, pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0))


def _visible_gpu_index() -> int:
    """NVML's index of the first GPU CUDA_VISIBLE_DEVICES names (NVML ignores that variable)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def last_logged_step(metrics_path: Path) -> int | None:
    try:
        lines = metrics_path.read_text().splitlines()
    except FileNotFoundError:
        return None
    steps = [json.loads(line).get("step") for line in lines[-3:] if line.strip().endswith("}")]
    steps = [step for step in steps if isinstance(step, int)]
    return max(steps) if steps else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe YAML, e.g. recipes/smoke.yaml")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the recipe's)")
    parser.add_argument("--warmup", type=int, default=None, help="steps excluded from timing (default: the recipe's)")
    parser.add_argument("--variants", default="fused,unfused", help="comma list of: " + ", ".join(VARIANT_OVERRIDES))
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant, alternating A B A B ... (>= 1)")
    parser.add_argument(
        "--baseline",
        default=None,
        help="variant the ratios divide by (default: unfused, else shipped-unfused, else the first)",
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
    parser.add_argument(
        "--heldout-samples",
        type=int,
        default=0,
        help="answer this many held-out records once, after each run's last step, and report the scores "
        "(default 0: off; the recipe needs data.eval_fraction > 0)",
    )
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
    for name in names:
        if VARIANT_OVERRIDES[name].get("train.master_weights") == "optimizer" and launcher is not None:
            left_out[name] = (
                "train.master_weights=optimizer runs only without --launcher (one process): DDP refuses it, FSDP2 "
                "already computes on bf16 weights"
            )
    kept = [v for v in names if v not in left_out]
    if not kept:  # one variant is a measurement of its own repeats' spread
        raise ConfigError(f"no variant left to run (left out: {left_out}).")
    return kept, left_out


def heldout_overrides(samples: int, steps: int) -> list[str]:
    """train.py overrides for --heldout-samples: one held-out evaluation, at the last step (none when 0)."""
    return [f"train.generate_every={steps}", f"train.generate_samples={samples}"] if samples else []


def last_heldout(metrics: list[dict]) -> dict | None:
    """The scores of a run's last held-out evaluation (its metrics.jsonl `gen_*` record, the prefix dropped, the
    generation's own seconds left out), or None when it made none."""
    record = next((r for r in reversed(metrics) if "gen_exact_match" in r), None)
    if record is None:
        return None
    scores = {key.removeprefix("gen_"): value for key, value in record.items() if key.startswith("gen_")}
    scores.pop("s", None)
    return {"step": record["step"], **scores}


def train_command(variant: str, model_type: str, launcher: str | None) -> list[str]:
    if variant == "liger":
        return [sys.executable, "-c", LIGER_BOOTSTRAP.format(family=model_type)]
    prefix = shlex.split(launcher) if launcher else [sys.executable]
    return [*prefix, "train.py"]


def run_variant(
    variant: str,
    repeat: int,
    args: argparse.Namespace,
    model_type: str,
    out_dir: Path,
    group: str,
    steps: int,
    warmup: int,
) -> RunResult:
    """Train one repeat of a variant in its own process; its console output goes to
    `<out>/<variant>/run<repeat>/train.log`."""
    run_dir = out_dir / variant / f"run{repeat}"
    run_dir.mkdir(parents=True, exist_ok=True)
    run_files.clear_results(run_dir)  # a rerun into the same --out must not read old numbers
    overrides = [
        *args.overrides,
        *(f"{k}={v}" for k, v in VARIANT_OVERRIDES[variant].items()),
        *heldout_overrides(args.heldout_samples, steps),
        f"train.output_dir={run_dir}",
        f"train.max_steps={steps}",
        f"logging.timing_warmup_steps={warmup}",
        f"logging.group={group}",
        f"logging.tags=[{variant}, compare]",
        f"logging.run_name={group}-{variant}-run{repeat}",
        "checkpoint.resume=null",
    ]
    command = [*train_command(variant, model_type, args.launcher), "--config", args.config, *overrides]
    print(f"[compare] {variant} run {repeat}: {shlex.join(command)}", flush=True)
    log_path = run_dir / "train.log"
    with BusySampler(run_dir / run_files.METRICS_FILE) as sampler:
        outcome = run_logged(command, log_path, args.run_timeout)
    wall = outcome.wall_s
    if outcome.code != 0:
        code = f"killed after --run-timeout {args.run_timeout} s" if outcome.code is None else outcome.code
        raise RuntimeError(
            f"variant {variant} run {repeat} failed ({code}); end of {log_path}:\n{log_tail(log_path, 30)}"
        )
    summary = run_files.read_summary(run_dir)
    records = run_files.training_records(run_dir)
    print(
        f"[compare] {variant} run {repeat}: done in {wall:.0f} s, {summary['tokens_per_s_per_gpu'] or 0:.0f} "
        "tokens/s/GPU"
    )
    heldout = last_heldout(run_files.read_metrics(run_dir))
    return RunResult(variant, repeat, run_dir, summary, records, wall, sampler.samples, heldout)


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else None


def max_abs_loss_gap(a: RunResult, b: RunResult) -> float | None:
    """max over the steps both runs logged of |loss_a - loss_b| (None when they share no step)."""
    loss_b = {r["step"]: r["loss"] for r in b.records}
    gaps = [abs(r["loss"] - loss_b[r["step"]]) for r in a.records if r["step"] in loss_b]
    return max(gaps) if gaps else None


def repeat_loss_noise(runs: list[RunResult]) -> float | None:
    """The largest |Δloss| of any later repeat against the first: same recipe, seed and batches, so what separates
    them is the GPU's run-to-run nondeterminism (atomics in backward kernels, autotuning) grown through the steps.
    None with one run."""
    gaps = [max_abs_loss_gap(later, runs[0]) for later in runs[1:]]
    gaps = [gap for gap in gaps if gap is not None]
    return max(gaps) if gaps else None


def pair_gaps(pairs: Iterable[tuple[RunResult, RunResult]]) -> dict | None:
    """max |Δloss| of each pair of runs, summarized: {median, max, pairs}; None without a pair that shares a step.
    Over every pair, not one draw: from a random init one pair's gap is itself a noisy draw (docs/numerics.md)."""
    gaps = [gap for gap in (max_abs_loss_gap(a, b) for a, b in pairs) if gap is not None]
    return {"median": statistics.median(gaps), "max": max(gaps), "pairs": len(gaps)} if gaps else None


def same_data(a: RunResult, b: RunResult) -> bool:
    """Whether two runs saw the same batches: identical per-step pack efficiency (real tokens / budget) at every
    step, which differs as soon as one step's batch does."""
    return [r["pack_efficiency"] for r in a.records] == [r["pack_efficiency"] for r in b.records]


def gpu_busy(result: RunResult, warmup: int) -> float | None:
    """Mean GPU utilisation over the samples taken while the timed steps ran: after step `warmup` was logged and
    before the last step was (module docstring); None without samples."""
    last = max((r["step"] for r in result.records), default=0)
    return _mean([busy for step, busy in result.busy_samples if warmup <= step < last])


def run_numbers(result: RunResult, warmup: int) -> dict:
    """One run: train.py's throughput over its timed steps and its GPU-busy fraction."""
    busy, summary = gpu_busy(result, warmup), result.summary
    return {
        "repeat": result.repeat,
        "tokens_per_s_per_gpu": summary["tokens_per_s_per_gpu"],
        "step_time_s": summary["timed_seconds"] / summary["timed_steps"] if summary["timed_steps"] else None,
        "mfu": summary["mfu"],
        "gpu_busy": busy,
        "host_bound": busy is not None and busy < HOST_BOUND_THRESHOLD,
        "run_dir": str(result.run_dir),
        "wandb_dir": summary.get("wandb_dir"),
        "wall_s": result.wall_s,
        "losses": [[r["step"], r["loss"]] for r in result.records],
        "heldout": result.heldout,
    }


def heldout_numbers(runs: list[RunResult]) -> dict | None:
    """A variant's held-out scores: {"step", "runs", and per score ("exact_match", "exact_match/<kind>", ...)
    {median, min, max} over the repeats that evaluated}; None when none did."""
    evaluated = [r.heldout for r in runs if r.heldout is not None]
    if not evaluated:
        return None
    keys = [key for key in evaluated[0] if key != "step"]
    keys += sorted({key for scores in evaluated for key in scores if key != "step"} - set(keys))
    numbers = {"step": evaluated[0]["step"], "runs": len(evaluated)}
    for key in keys:
        values = [scores[key] for scores in evaluated if scores.get(key) is not None]
        if values:
            numbers[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return numbers


def heldout_gap(a: dict | None, b: dict | None) -> dict | None:
    """Held-out exact match of variant a minus variant b: the gap of the medians, the range the repeats allow
    (min(a)-max(b) .. max(a)-min(b)), each variant's own spread over its repeats (max-min: the noise the gap is read
    against) and the gap of the medians per question kind both report; None unless both evaluated."""
    if a is None or b is None or "exact_match" not in a or "exact_match" not in b:
        return None
    ours, theirs = a["exact_match"], b["exact_match"]
    gap = ours["median"] - theirs["median"]
    spreads = (ours["max"] - ours["min"], theirs["max"] - theirs["min"])
    kinds = sorted(key for key in a if key.startswith("exact_match/") and key in b)
    return {
        "gap": gap,
        "min": ours["min"] - theirs["max"],
        "max": ours["max"] - theirs["min"],
        "spread_a": spreads[0],
        "spread_b": spreads[1],
        "within_repeat_spread": abs(gap) <= max(spreads),
        "by_kind": {key.split("/", 1)[1]: a[key]["median"] - b[key]["median"] for key in kinds},
    }


def variant_numbers(runs: list[RunResult], warmup: int) -> dict:
    """One row of the table: medians over the variant's repeats with their spread, plus the first repeat's
    memory, loss and data figures (the same in every repeat: same seed and batches)."""
    per_run = [run_numbers(r, warmup) for r in runs]
    speeds = [r["tokens_per_s_per_gpu"] for r in per_run if r["tokens_per_s_per_gpu"] is not None]
    median_speed = _median(speeds)
    first = runs[0]
    return {
        "tokens_per_s_per_gpu": median_speed,
        "tokens_per_s_min": min(speeds) if speeds else None,
        "tokens_per_s_max": max(speeds) if speeds else None,
        "tokens_per_s_spread": (max(speeds) - min(speeds)) / median_speed if median_speed else None,
        "step_time_s": _median([r["step_time_s"] for r in per_run]),
        "mfu": _median([r["mfu"] for r in per_run]),
        "gpu_busy": _median([r["gpu_busy"] for r in per_run]),
        "host_bound": any(r["host_bound"] for r in per_run),
        "peak_mem_gib": first.summary["peak_mem_gib"],
        "loss_end": first.summary["loss_end"],
        "pack_efficiency": _mean([r["pack_efficiency"] for r in first.records if r["step"] > warmup]),
        "timed_steps": first.summary["timed_steps"],
        "fused_rope": first.summary["fused_rope"],
        "max_abs_dloss_repeats": repeat_loss_noise(runs),
        "dloss_repeat_pairs": pair_gaps(itertools.combinations(runs, 2)),
        "heldout": heldout_numbers(runs),
        "runs": per_run,
    }


def compare(results: list[RunResult], baseline: str, warmup: int) -> dict:
    """Rows per variant (medians over its repeats) with ratios of medians to `baseline`; |Δloss| and same-data
    checks of the first repeats against the baseline's packing-mode peer (padded runs see different batches, so
    their losses are compared only with each other)."""
    by_name: dict[str, list[RunResult]] = {}
    for result in results:
        by_name.setdefault(result.variant, []).append(result)
    base = by_name[baseline][0]
    rows = {name: variant_numbers(runs, warmup) for name, runs in by_name.items()}
    base_row = rows[baseline]
    for name, row in rows.items():
        for key in ("tokens_per_s_per_gpu", "step_time_s", "mfu"):
            ours, theirs = row[key], base_row[key]
            row[f"{key}_ratio"] = ours / theirs if ours is not None and theirs else None
        peer = base if (name == "padded") == (baseline == "padded") else None
        row["max_abs_dloss_vs_baseline"] = None if peer is None else max_abs_loss_gap(by_name[name][0], peer)
        row["same_data_as_baseline"] = None if peer is None else same_data(by_name[name][0], peer)
        row["dloss_vs_baseline_pairs"] = (
            None if peer is None or name == baseline else pair_gaps(itertools.product(by_name[name], by_name[baseline]))
        )
    named = {}
    if "fused" in rows and "unfused" in rows:
        named["fused/unfused tokens/s"] = _ratio(rows["fused"], rows["unfused"])
        named["fused vs unfused max |dloss|"] = max_abs_loss_gap(by_name["fused"][0], by_name["unfused"][0])
        named["fused repeats max |dloss|"] = rows["fused"]["max_abs_dloss_repeats"]
        named["unfused repeats max |dloss|"] = rows["unfused"]["max_abs_dloss_repeats"]
        named["fused vs unfused |dloss|, every pair"] = pair_gaps(
            itertools.product(by_name["fused"], by_name["unfused"])
        )
        named["fused repeats |dloss|, every pair"] = rows["fused"]["dloss_repeat_pairs"]
        named["unfused repeats |dloss|, every pair"] = rows["unfused"]["dloss_repeat_pairs"]
    if "shipped" in rows and "shipped-unfused" in rows:
        named["shipped fused/unfused tokens/s"] = _ratio(rows["shipped"], rows["shipped-unfused"])
        named["shipped fused vs unfused max |dloss|"] = max_abs_loss_gap(
            by_name["shipped"][0], by_name["shipped-unfused"][0]
        )
    if "fused" in rows and "padded" in rows:
        named["packed/padded tokens/s"] = _ratio(rows["fused"], rows["padded"])
    if "fused" in rows and "compiled" in rows:
        named["compiled/fused tokens/s"] = _ratio(rows["compiled"], rows["fused"])
    if "fused" in rows and "liger" in rows:
        named["fused/liger tokens/s"] = _ratio(rows["fused"], rows["liger"])
    if "fused" in rows and "bf16-weights" in rows:
        named["bf16-weights/fused tokens/s"] = _ratio(rows["bf16-weights"], rows["fused"])
        named["bf16-weights vs fused max |dloss|"] = max_abs_loss_gap(by_name["bf16-weights"][0], by_name["fused"][0])
    for label, a, b in HELDOUT_PAIRS:
        gap = heldout_gap(rows[a]["heldout"], rows[b]["heldout"]) if a in rows and b in rows else None
        if gap is not None:
            named[f"{label} held-out exact match"] = gap
    return {"baseline": baseline, "host_bound_threshold": HOST_BOUND_THRESHOLD, "variants": rows, "ratios": named}


def _ratio(a: dict, b: dict) -> dict | None:
    """Ratio of the medians, and the range the repeats allow: min(a)/max(b) .. max(a)/min(b)."""
    if a["tokens_per_s_per_gpu"] is None or not b["tokens_per_s_per_gpu"]:
        return None
    return {
        "median": a["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"],
        "min": a["tokens_per_s_min"] / b["tokens_per_s_max"],
        "max": a["tokens_per_s_max"] / b["tokens_per_s_min"],
    }


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(comparison: dict) -> str:
    """The side-by-side table as Markdown (it pastes into the README as is)."""
    baseline = comparison["baseline"]
    with_heldout = any(row["heldout"] for row in comparison["variants"].values())
    lines = [
        f"| variant | runs | tokens/s/GPU (median, min–max) | × {baseline} | step time (s) | MFU "
        f"| GPU busy | peak mem (GiB) | final loss | max \\|Δloss\\| vs {baseline} | max \\|Δloss\\| of its repeats |"
        + (" held-out exact match (median, min–max) |" if with_heldout else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if with_heldout else ""),
    ]
    for name, row in comparison["variants"].items():
        mfu = None if row["mfu"] is None else 100 * row["mfu"]
        gap = row["max_abs_dloss_vs_baseline"]
        gap_text = "other batches" if gap is None and name != baseline else _fmt(gap, ".2e")
        busy = _fmt(row["gpu_busy"], ".2f") + (" host-bound" if row["host_bound"] else "")
        lines.append(
            f"| {name} | {len(row['runs'])} | {_fmt(row['tokens_per_s_per_gpu'], ',.0f')} "
            f"({_fmt(row['tokens_per_s_min'], ',.0f')}–{_fmt(row['tokens_per_s_max'], ',.0f')}) "
            f"| {_fmt(row['tokens_per_s_per_gpu_ratio'], '.3f')} "
            f"| {_fmt(row['step_time_s'], '.3f')} | {_fmt(mfu, '.1f')}{'%' if mfu is not None else ''} "
            f"| {busy} | {_fmt(row['peak_mem_gib'], '.1f')} | {_fmt(row['loss_end'], '.4f')} | {gap_text} "
            f"| {_fmt(row['max_abs_dloss_repeats'], '.2e')} |"
            + (f" {heldout_cell(row['heldout'])} |" if with_heldout else "")
        )
    return "\n".join(lines)


def heldout_cell(heldout: dict | None) -> str:
    """Exact match over the repeats as a table cell: median (min–max), with the step evaluated."""
    if heldout is None or "exact_match" not in heldout:
        return "–"
    em = heldout["exact_match"]
    return f"{em['median']:.3f} ({em['min']:.3f}–{em['max']:.3f}) at step {heldout['step']}"


def ratio_lines(ratios: dict) -> str:
    lines = []
    for name, value in ratios.items():
        if isinstance(value, dict) and "gap" in value:
            noise = f"spread of the repeats {value['spread_a']:.3f} and {value['spread_b']:.3f}"
            verdict = "within" if value["within_repeat_spread"] else "outside"
            lines.append(
                f"- {name}: gap {value['gap']:+.3f} (repeats allow {value['min']:+.3f}..{value['max']:+.3f}; "
                f"{noise}: {verdict} it)"
            )
        elif isinstance(value, dict) and "pairs" in value:
            lines.append(f"- {name}: median {value['median']:.4g}, max {value['max']:.4g} ({value['pairs']} pairs)")
        elif isinstance(value, dict):
            lines.append(f"- {name}: {value['median']:.3f} (repeats allow {value['min']:.3f}–{value['max']:.3f})")
        else:
            lines.append(f"- {name}: {_fmt(value, '.4g')}")
    return "\n".join(lines)


def first_runs(results: list[RunResult]) -> dict[str, RunResult]:
    """Each variant's first finished run (its first repeat unless that one failed), in run order."""
    firsts: dict[str, RunResult] = {}
    for result in results:
        firsts.setdefault(result.variant, result)
    return firsts


def plot(results: list[RunResult], warmup: int, title: str, path: Path) -> None:
    """tokens/s per GPU and loss against the step, one line per variant (its first finished run); warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.5))
    for result in first_runs(results).values():
        logged = [r for r in result.records if "tokens_per_s_per_gpu" in r]
        ax_speed.plot([r["step"] for r in logged], [r["tokens_per_s_per_gpu"] for r in logged], label=result.variant)
        ax_loss.plot([r["step"] for r in result.records], [r["loss"] for r in result.records], label=result.variant)
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


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    reserved = RESERVED_KEYS | HELDOUT_KEYS if args.heldout_samples else RESERVED_KEYS
    clashes = sorted({override_key(o) for o in args.overrides} & reserved)
    if clashes:
        raise ConfigError(
            f"{clashes} are set by the comparison itself; use --steps/--warmup/--variants/--group/--heldout-samples."
        )
    cfg = load_config(args.config, args.overrides)  # validates the recipe and overrides before any run starts
    model_type = hf_config(cfg.model).model_type
    variants, left_out = select_variants(args.variants, model_type, args.launcher)
    for name, reason in left_out.items():
        print(f"[compare] variant {name} left out: {reason}", flush=True)
    baseline = args.baseline or next((v for v in ("unfused", "shipped-unfused") if v in variants), variants[0])
    if baseline not in variants:
        raise ConfigError(f"--baseline {baseline} is not among the variants run ({', '.join(variants)}).")
    steps = args.steps or cfg.train.max_steps
    warmup = cfg.logging.timing_warmup_steps if args.warmup is None else args.warmup
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats}: need at least one run per variant.")
    if steps <= warmup:
        raise ConfigError(f"--steps {steps} must exceed the {warmup} warm-up steps (set --warmup or --steps).")
    if args.heldout_samples < 0:
        raise ConfigError(f"--heldout-samples {args.heldout_samples}: 0 (off) or a number of held-out records.")
    if args.heldout_samples:  # the recipe must have a held-out split (data.eval_fraction): refused before any run
        load_config(args.config, [*args.overrides, *heldout_overrides(args.heldout_samples, steps)])
    recipe = Path(args.config).stem
    out_dir = Path(args.out or f"artifacts/compare/{recipe}").resolve()
    group = args.group or f"compare-{recipe}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
    env_info = provenance()
    print(
        f"[compare] {recipe}: {', '.join(variants)} x {args.repeats} alternating; {steps} steps, {warmup} warm-up; "
        f"wandb group {group}"
    )

    order = [(v, repeat) for repeat in range(1, args.repeats + 1) for v in variants]  # A B A B ...
    out_dir.mkdir(parents=True, exist_ok=True)
    named = env_info["commit"] or f"source {env_info['source_sha256'][:12]}"
    title = f"{recipe} — {env_info['gpu']['name']}, {env_info['date_utc']} UTC, {named}"
    results: list[RunResult] = []
    failed: list[dict] = []
    report = None
    for index, (variant, repeat) in enumerate(order):
        try:
            results.append(run_variant(variant, repeat, args, model_type, out_dir, group, steps, warmup))
        except RuntimeError as error:  # a failed or stalled run is reported; the other runs still count
            print(f"[compare] {variant} run {repeat} failed; the comparison goes on: {error}", flush=True)
            failed.append({"variant": variant, "repeat": repeat, "error": str(error).splitlines()[0]})
        # After each full round, so a session cut short (a time limit) still leaves the rounds it finished.
        if variant == variants[-1] and any(r.variant == baseline for r in results):
            report = {
                "recipe": args.config,
                "overrides": args.overrides,
                "steps": steps,
                "warmup_steps": warmup,
                "repeats": repeat,
                "run_order": [list(item) for item in order[: index + 1]],
                "failed": failed,
                "wandb_group": group,
                "left_out": left_out,
                "environment": env_info,
                **compare(results, baseline, warmup),
                "curves": {name: run.records for name, run in first_runs(results).items()},
            }
            text, ratios = table(report), ratio_lines(report["ratios"])
            (out_dir / "comparison.json").write_text(json.dumps(report, indent=2) + "\n")
            (out_dir / "comparison.md").write_text(f"{title}\n\n{text}\n\n{ratios}\n")
    if report is None:
        raise RuntimeError(f"no run of the baseline {baseline} finished: {failed}")
    plot(results, warmup, title, out_dir / "comparison.png")
    print(f"\n{title}\n\n{text}\n\n{ratios}\n")
    print(f"[compare] wrote {out_dir}/comparison.{{json,png,md}}")
    return report


def command_line(argv: list[str] | None = None) -> int | str:
    """`main` as a process's exit status: 0, or the one line (an error, or how many runs failed) it exits with."""
    try:
        failures = main(argv)["failed"]
    except (ConfigError, RuntimeError) as error:
        return f"[compare] error: {error}"
    if failures:
        return f"[compare] {len(failures)} run(s) failed; comparison.json lists them under 'failed'"
    return 0
