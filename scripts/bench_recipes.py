"""`make bench-recipes`: the shipped recipes measured as a user launches them, against the eager fp32 path on the same
machine, into one result file.

    python -m scripts.bench_recipes [--stage one-gpu|two-gpu|moe|all] [--recipes NAME,...] [--variants shipped,...]
        [--budget-s 540] [--steps 30] [--warmup 10] [--repeats 2] [--work artifacts/bench-recipes]
        [--out docs/results/recipes-<date>.json] [--dry-run]

What runs. Each recipe of the stage at full depth and real width (its recipes/models/*.json, random init), with its
own accelerate config and pack: one GPU for qwen2_5_vl-3b, qwen3_vl-2b, qwen3_5-2b and the three LoRA recipes
(`one-gpu`); FSDP2 over two GPUs for qwen2_5_vl-7b, qwen3_vl-8b and qwen3_5-9b (`two-gpu`); and qwen3_5-35b_a3b under
FSDP2 over two GPUs with fewer decoder layers, the largest of MOE_LAYERS whose run fits (`moe`; the first that
finishes is kept, and the JSON says so). `--recipes` keeps some of the stage's recipes, `--variants` runs only some
variants now (the report still covers every finished run, and lists the others as pending). Two variants of
verification/throughput_compare.py, alternating A B A B over `--repeats` rounds:
`shipped` (the recipe as it ships: its `auto` settings resolved, trainer/defaults.py) and `eager-fp32` (eager blocks,
fp32 module weights under autocast, transformers' Conv3d patch embedding, 2 loader workers, the recipe's
checkpointing). Every run trains `--steps` steps from the same seed on the same batches (the recipe's data with
COMMON_OVERRIDES: fewer built-in samples to process at start-up, no eval, checkpoint or export); throughput is
train.py's own mean over the steps after `--warmup` (the compile falls in step 1).

Stages. A run takes minutes, a recipe's four of them more than one 10-minute device call, so the script is
resumable: finished runs are kept in `--work` (state.json, one run directory each) and an invocation runs pending
runs in order until the next would pass `--budget-s` (estimated from the slowest finished run of its recipe, else
`--first-run-estimate-s`), then writes the report and exits; call it again for the rest (exit status 3 while runs are
pending). `--dry-run` prints the plan.

The report (`--out`): provenance (verification/provenance.py: commit or source digest, GPU, library versions), the
targets, and per recipe: launch, overrides, note; for each variant tokens/s per GPU (median, min, max over its runs),
MFU (FLOPs counting the lm_head for labelled rows only: trainer/metrics.py), peak memory, GPU busy, step 1's wall
time and the part of it inductor spent compiling (first run of each variant); the speedup
of shipped over eager-fp32 (ratio of medians, with the range the runs allow); step 1 of each variant's first run
(loss, gradient norm) and the gaps against the numerics rule (STEP1_RULE); whether the targets are met; and the runs
still pending.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

from core.config import load_config
from core.config_tree import ConfigError
from core.families import recipe_model_config
from lifecycle import run_files
from verification import throughput_compare as compare
from verification.provenance import provenance

ONE_GPU = "accelerate launch --config_file recipes/accelerate/single_gpu.yaml"
FSDP2_TWO = "accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes 2"
# What every run shares beyond the recipe: a smaller built-in dataset (its processing is start-up time, not step
# time), no held-out split, no checkpoint or export (disk time, not step time), and a memory check that only warns:
# a run the estimate puts over the GPU's memory still runs, so its real peak (or its OOM) calibrates the estimate.
COMMON_OVERRIDES = (
    "data.num_samples=3000",
    "data.eval_fraction=0",
    "train.eval_every=0",
    "checkpoint.every_steps=0",
    "checkpoint.save_final=false",
    "checkpoint.export=false",
    "logging.report_to=none",
    "logging.every_steps=5",
    "logging.progress_bar=false",
    "train.memory_check=warn",
)
VARIANTS = ("shipped", "eager-fp32")
BASELINE = "eager-fp32"
MOE_LAYERS = (16, 12, 8)  # decoder layers tried for the MoE recipe on two GPUs, largest first (all of the 3:1 pattern)
FIRST_RUN_ESTIMATE_S = 300  # a recipe's first run, by default: data processing, model init, compile and the steps
TARGETS = {
    "speedup_vs_eager_fp32": 1.5,
    "mfu": {"qwen2_5_vl": 0.45, "qwen3_vl": 0.45, "qwen3_5": 0.40, "qwen3_5_moe": 0.40},
    "mfu_lora_one_gpu": 0.40,
}
STEP1_RULE = {"grad_norm_relative": 1e-2, "loss_absolute": 1e-2}  # the numerics rule a default must keep


@dataclass(frozen=True)
class Bench:
    """One recipe's benchmark: the recipe, how it launches, its stage and what (if anything) it changes."""

    recipe: str
    launcher: str
    stage: str
    moe: bool = False

    @property
    def name(self) -> str:
        return Path(self.recipe).stem


BENCHES = (
    Bench("recipes/qwen2_5_vl-3b.yaml", ONE_GPU, "one-gpu"),
    Bench("recipes/qwen3_vl-2b.yaml", ONE_GPU, "one-gpu"),
    Bench("recipes/qwen3_5-2b.yaml", ONE_GPU, "one-gpu"),
    Bench("recipes/lora-qwen2_5_vl-7b.yaml", ONE_GPU, "one-gpu"),
    Bench("recipes/lora-qwen3_vl-8b.yaml", ONE_GPU, "one-gpu"),
    Bench("recipes/lora-qwen3_5-9b.yaml", ONE_GPU, "one-gpu"),
    Bench("recipes/qwen2_5_vl-7b.yaml", FSDP2_TWO, "two-gpu"),
    Bench("recipes/qwen3_vl-8b.yaml", FSDP2_TWO, "two-gpu"),
    Bench("recipes/qwen3_5-9b.yaml", FSDP2_TWO, "two-gpu"),
    Bench("recipes/qwen3_5-35b_a3b.yaml", FSDP2_TWO, "moe", moe=True),
)
STAGES = ("one-gpu", "two-gpu", "moe")


def moe_overrides(layers: int) -> list[str]:
    """The MoE recipe cut to `layers` decoder layers, Qwen3.5's pattern of three Gated DeltaNet layers per attention
    layer kept."""
    pattern = ["linear_attention"] * 3 + ["full_attention"]
    types = ",".join((pattern * (layers // 4))[:layers])
    return [f"model.config.text_config.num_hidden_layers={layers}", f"model.config.text_config.layer_types=[{types}]"]


@dataclass(frozen=True)
class Unit:
    """One train.py run of the plan."""

    bench: Bench
    variant: str
    repeat: int
    moe_layers: int | None = None

    @property
    def key(self) -> str:
        layers = f"-{self.moe_layers}layers" if self.moe_layers else ""
        return f"{self.bench.name}{layers}/{self.variant}/{self.repeat}"

    def overrides(self) -> list[str]:
        return [*COMMON_OVERRIDES, *(moe_overrides(self.moe_layers) if self.moe_layers else [])]


class State:
    """The finished and failed runs, kept in `<work>/state.json` between invocations."""

    def __init__(self, work: Path):
        self.path = work / "state.json"
        self.data = json.loads(self.path.read_text()) if self.path.is_file() else {"done": {}, "failed": {}}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        run_files.write_atomically(self.path, json.dumps(self.data, indent=2) + "\n")

    def done(self, unit: Unit) -> dict | None:
        return self.data["done"].get(unit.key)

    def pending(self, unit: Unit) -> bool:
        return unit.key not in self.data["done"] and unit.key not in self.data["failed"]

    def slowest_run(self, unit: Unit) -> float | None:
        """The longest wall time of a finished run of `unit`'s recipe (and MoE layer count), None before the first."""
        prefix = unit.key.rsplit("/", 2)[0] + "/"
        return max((r["wall_s"] for key, r in self.data["done"].items() if key.startswith(prefix)), default=None)

    def moe_layers(self, bench: Bench) -> int | None:
        """The MoE layer count in use: the largest of MOE_LAYERS with no failed run (None when every one failed)."""
        return next((n for n in MOE_LAYERS if not self._failed_with(bench, n)), None)

    def _failed_with(self, bench: Bench, layers: int) -> bool:
        return any(key.startswith(f"{bench.name}-{layers}layers/") for key in self.data["failed"])


def plan(benches: list[Bench], repeats: int, state: State, variants: tuple[str, ...] = VARIANTS) -> list[Unit]:
    """Every run of `variants` of the benches, recipe by recipe, the variants alternating within each round."""
    units = []
    for bench in benches:
        layers = state.moe_layers(bench) if bench.moe else None
        if bench.moe and layers is None:
            continue  # no layer count fits: the report says so
        units += [Unit(bench, v, r, layers) for r in range(1, repeats + 1) for v in variants]
    return units


def run_unit(unit: Unit, work: Path, steps: int, warmup: int, run_timeout: int) -> compare.RunResult:
    """Train one run through throughput_compare's runner (its variant's overrides, its own process)."""
    args = SimpleNamespace(
        config=unit.bench.recipe, overrides=unit.overrides(), launcher=unit.bench.launcher, run_timeout=run_timeout
    )
    out_dir = work / unit.key.rsplit("/", 2)[0]
    return compare.run_variant(unit.variant, unit.repeat, args, "", out_dir, "bench-recipes", steps, warmup)


def stored(unit: Unit, work: Path, record: dict) -> compare.RunResult:
    """A finished run read back from its run directory and the state's record of it."""
    run_dir = work / unit.key.rsplit("/", 2)[0] / unit.variant / f"run{unit.repeat}"
    return compare.RunResult(
        unit.variant,
        unit.repeat,
        run_dir,
        run_files.read_summary(run_dir),
        run_files.training_records(run_dir),
        record["wall_s"],
        [tuple(sample) for sample in record["busy_samples"]],
    )


def step_one(first: compare.RunResult, baseline: compare.RunResult) -> dict:
    """Step 1's loss and gradient norm of a shipped run against the eager fp32 run, and whether they keep the rule."""
    ours, theirs = first.records[0], baseline.records[0]
    loss_gap = abs(ours["loss"] - theirs["loss"])
    norm_gap = abs(ours["grad_norm"] - theirs["grad_norm"]) / theirs["grad_norm"]
    return {
        "loss": ours["loss"],
        "loss_eager_fp32": theirs["loss"],
        "loss_absolute_gap": loss_gap,
        "grad_norm": ours["grad_norm"],
        "grad_norm_eager_fp32": theirs["grad_norm"],
        "grad_norm_relative_gap": norm_gap,
        "within_rule": loss_gap <= STEP1_RULE["loss_absolute"] and norm_gap <= STEP1_RULE["grad_norm_relative"],
    }


def first_step(run: compare.RunResult) -> dict:
    """Step 1's wall time and inductor's compile time within it, as train.py logged them (None where it did not)."""
    record = next((r for r in run_files.read_metrics(run.run_dir) if "first_step_s" in r), {})
    return {"first_step_s": record.get("first_step_s"), "compile_s": record.get("compile_s")}


def mfu_target(recipe: str) -> float:
    """The recipe's MFU target: by family for a full fine-tune, one figure for LoRA on one GPU."""
    cfg = load_config(recipe)
    if cfg.lora is not None:
        return TARGETS["mfu_lora_one_gpu"]
    return TARGETS["mfu"][recipe_model_config(cfg.model.config)["model_type"]]


def recipe_row(bench: Bench, units: list[Unit], results: dict[str, compare.RunResult], warmup: int) -> dict:
    """One recipe's numbers (module docstring) from its finished runs; None-valued where runs are missing."""
    model_cfg = load_config(bench.recipe).model
    runs = {v: [results[u.key] for u in units if u.variant == v and u.key in results] for v in VARIANTS}
    row: dict = {
        "recipe": bench.recipe,
        "launch": bench.launcher,
        "overrides": units[0].overrides() if units else [],
        "model_config": model_cfg.config,
    }
    if bench.moe and units:
        row["note"] = (
            f"reduced to {units[0].moe_layers} of 40 decoder layers, the largest of {list(MOE_LAYERS)} whose run "
            "fits two H200s (full depth needs 8); widths, experts and vocabulary as published"
        )
    for variant, variant_runs in runs.items():
        row[variant] = (
            {**compare.variant_numbers(variant_runs, warmup), **first_step(variant_runs[0])} if variant_runs else None
        )
    shipped, eager = row["shipped"], row[BASELINE]
    row["mfu_target"] = mfu_target(bench.recipe)
    if shipped:
        row["meets"] = {"mfu": shipped["mfu"] is not None and shipped["mfu"] >= row["mfu_target"]}
    if shipped and eager:
        row["speedup_vs_eager_fp32"] = compare._ratio(shipped, eager)
        row["step1"] = step_one(runs["shipped"][0], runs[BASELINE][0])
        row["meets"] |= {
            "speedup": row["speedup_vs_eager_fp32"]["median"] >= TARGETS["speedup_vs_eager_fp32"],
            "step1_rule": row["step1"]["within_rule"],
        }
    return row


def report(benches: list[Bench], units: list[Unit], state: State, work: Path, args) -> dict:
    results = {u.key: stored(u, work, state.done(u)) for u in units if state.done(u)}
    recipes = {}
    for bench in benches:
        mine = [u for u in units if u.bench == bench]
        if bench.moe and not mine:
            recipes[bench.name] = {"recipe": bench.recipe, "note": f"no layer count of {list(MOE_LAYERS)} fit"}
            continue
        recipes[bench.name] = recipe_row(bench, mine, results, args.warmup)
    return {
        "provenance": provenance(),
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "repeats": args.repeats,
        "variants": {v: compare.VARIANT_OVERRIDES[v] for v in VARIANTS},
        "common_overrides": list(COMMON_OVERRIDES),
        "targets": TARGETS,
        "step1_rule": STEP1_RULE,
        "recipes": recipes,
        "failed": state.data["failed"],
        "pending": [u.key for u in units if state.pending(u)],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=[*STAGES, "all"], default="all", help="which recipes (module docstring)")
    parser.add_argument("--recipes", default=None, help="comma list of the stage's recipe names, run in this order")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)} to run")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput (compile, allocator)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant, alternating (>= 2 for a range)")
    parser.add_argument("--budget-s", type=float, default=540, help="stop before a run that would pass this")
    parser.add_argument(
        "--first-run-estimate-s", type=float, default=FIRST_RUN_ESTIMATE_S, help="a recipe's first run, for --budget-s"
    )
    parser.add_argument("--run-timeout", type=int, default=1500, help="seconds one run may take")
    parser.add_argument("--work", default="artifacts/bench-recipes", help="run directories and state.json")
    parser.add_argument("--out", default=None, help="the report (default: docs/results/recipes-<UTC date>.json)")
    parser.add_argument("--dry-run", action="store_true", help="print the pending runs and exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run what the budget allows, write the report; 0 when nothing is pending, 3 while runs are."""
    args = parse_args(argv)
    if args.repeats < 1 or args.steps <= args.warmup:
        raise ConfigError("need --repeats >= 1 and --steps above --warmup.")
    work = Path(args.work)
    out = Path(args.out or f"docs/results/recipes-{datetime.now(UTC).strftime('%Y-%m-%d')}.json")
    benches = [b for b in BENCHES if args.stage in (b.stage, "all")]
    if args.recipes:
        names = args.recipes.split(",")
        unknown = sorted(set(names) - {b.name for b in benches})
        if unknown:
            raise ConfigError(f"--recipes: {unknown} not in stage {args.stage}: {[b.name for b in benches]}.")
        benches = [next(b for b in benches if b.name == name) for name in dict.fromkeys(names)]  # in --recipes order
    variants = tuple(args.variants.split(","))
    if not variants or not set(variants) <= set(VARIANTS):
        raise ConfigError(f"--variants {args.variants!r}: choose from {', '.join(VARIANTS)}.")
    state = State(work)
    started = time.monotonic()
    if args.dry_run:
        pending = [u for u in plan(benches, args.repeats, state, variants) if state.pending(u)]
        print("\n".join(f"[bench-recipes] pending {u.key}: {u.bench.launcher} {u.bench.recipe}" for u in pending))
        return 3 if pending else 0
    while pending := [u for u in plan(benches, args.repeats, state, variants) if state.pending(u)]:
        unit = pending[0]
        estimate = state.slowest_run(unit) or args.first_run_estimate_s
        if time.monotonic() - started + estimate > args.budget_s:
            print(f"[bench-recipes] stopping before {unit.key}: ~{estimate:.0f} s would pass --budget-s", flush=True)
            break
        try:
            result = run_unit(unit, work, args.steps, args.warmup, args.run_timeout)
        except RuntimeError as error:  # an OOM or a stall: recorded and not retried (an MoE run: fewer layers next)
            state.data["failed"][unit.key] = str(error).splitlines()[0]
            print(f"[bench-recipes] {unit.key} failed: {error}", flush=True)
        else:
            state.data["done"][unit.key] = {"wall_s": result.wall_s, "busy_samples": result.busy_samples}
        state.save()
    units = plan(benches, args.repeats, state)
    result = report(benches, units, state, work, args)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_files.write_atomically(out, json.dumps(result, indent=2) + "\n")
    print(f"[bench-recipes] wrote {out}; {len(result['pending'])} run(s) pending", flush=True)
    return 3 if result["pending"] else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as error:
        sys.exit(f"[bench-recipes] error: {error}")
