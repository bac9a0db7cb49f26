r"""N GPUs against one on the same packs per optimizer step: loss parity, tokens/s scaling, peak memory, FSDP2
resume/export.

    python -m scripts.distributed_parity --out artifacts/distributed/parity.json [--gpus 2] \
        [--layouts single,ddp,fsdp2] [--packs-per-step P] [--baseline earlier.json,…] \
        [--recipes recipes/smoke.yaml,recipes/bench-qwen2_5_vl-3b-shape.yaml] [--steps 30] [--shape-steps 16] \
        [--no-resume | --resume-all] [--repeat-single] [--repeat-fast] [--fast-override KEY=VALUE ...] \
        [dotted.key=value ...]

For each recipe, separate launches of train.py (every one with NVLink multicast off, core/distributed.py):
  single   one GPU, P accumulation micro-steps per optimizer step    python train.py
           (every layout runs REFERENCE_PATH, eager with fp32 module weights, unless the user's overrides change it)
  single-repeat   the same launch again (--repeat-single)
  bf16-compiled   one GPU on bf16 weights with fp32 masters in the optimizer, compiled, the matmul patch
                  embedding    python train.py train.master_weights=optimizer train.compile=true
                  kernels.patch_embed=matmul (only when --layouts names it): the one-GPU path the recipes ship
                  with, judged against the 1-GPU run like a layout (the numerics rule of a default:
                  docs/numerics.md); each --fast-override KEY=VALUE is added to its launch alone (a lever whose
                  numerics the curve judges, while the 1-GPU run stays the reference path)
  bf16-compiled-repeat   the same launch again (--repeat-fast): a second draw of its gap to the 1-GPU run, for
                  scripts/curve_spread.py, which pools such draws against the 1-GPU runs' repeats
  ddp      N GPUs, P/N micro-steps each                              accelerate launch … ddp.yaml
  fsdp2    N GPUs, sharded, with a checkpoint halfway                accelerate launch … fsdp2.yaml
  resume   fsdp2 again from that checkpoint, then its export loaded on the CPU (first recipe only; every recipe
           with --resume-all; none with --no-resume or without fsdp2 in --layouts)
N = --gpus (default 2); P = --packs-per-step (default N), the packs of one optimizer step. Every layout trains on
the same P packs per optimizer step: each rank accumulates P/ranks micro-steps and `packing.balance_window_steps`
is set to that count, so the loader's balance window (ranks × window steps = P packs) is exactly one optimizer
step, dealt either to P/N micro-steps of N ranks or to P micro-steps of one (data/pipeline.py, StepLoader). The
loss is normalised by the global label count, so the curves may differ only by reduction order in bf16 (and by
FSDP2's bf16 parameters). Two checks of that:
  step 1   the gradient norm before any update (same weights, same packs) within --grad-norm-tol (relative) of the
           1-GPU run's: a wrong normalisation or a rank on other data shows here, before training amplifies noise;
  curves   every step's |Δloss| within --loss-tol, or, with --repeat-single, within 2x the gap between the 1-GPU
           run and its own repeat if larger. The 1-GPU run is not bit-reproducible on the GPU, and from a random
           init Adam's first steps grow its last-bit differences to tenths of a nat at the full-depth 3B shape
           (docs/numerics.md), so there a fixed tolerance judges the reference's noise, not the layout.
Scaling efficiency = tokens/s per GPU ÷ tokens/s on one GPU (train.py's means after the warm-up steps). Prints a
table and writes every number (and the per-step losses and gradient norms) as JSON to --out.

--layouts runs a subset: a shape whose states do not fit one GPU skips `single`. The 1-GPU reference of the
"vs 1 GPU" columns is then the single layout of --baseline, if given, else they stay empty.
--baseline takes --out files of earlier runs (comma list; layouts matched by recipe file name and layout name, a
later file's replacing an earlier's), e.g. the 2-GPU runs of the same recipes: besides lending their single
layout, each layout here is compared with the baseline's layout of the same name ("vs baseline": fsdp2 on 4 GPUs
÷ fsdp2 on 2). tokens/s are always compared; losses only when that baseline layout ran the same --steps with the
same packs per optimizer step (a 2-GPU baseline for a 4-GPU run: --packs-per-step 4) and the same overrides.
Files written before --packs-per-step existed (2 packs per step, overrides not recorded) lend tokens/s only.

FSDP2 on 4 and 8 GPUs (7B-class Qwen2.5-VL and Qwen3-VL-8B shapes, 16k-token packs):
  S=recipes/bench-qwen2_5_vl-7b-shape.yaml,recipes/bench-qwen3_vl-8b-shape.yaml A=artifacts/distributed
  # 2 GPUs: 1 GPU (twice: its own noise) and FSDP2 at 4 packs per step, FSDP2 at 8 (the packs per step of the 4-
  # and 8-GPU runs)
  python -m scripts.distributed_parity --out $A/parity-2gpu-p4.json --gpus 2 --packs-per-step 4 --repeat-single \
      --layouts single,fsdp2 --no-resume --steps 12 --shape-steps 12 --launch-timeout 540 --recipes $S
  python -m scripts.distributed_parity --out $A/parity-2gpu-p8.json --gpus 2 --packs-per-step 8 \
      --layouts fsdp2 --no-resume --steps 12 --shape-steps 12 --recipes $S
  # 4 GPUs
  python -m scripts.distributed_parity --out $A/parity-4gpu.json --gpus 4 --layouts fsdp2 --no-resume \
      --steps 12 --shape-steps 12 --recipes $S --baseline $A/parity-2gpu-p4.json
  # 8 GPUs: 1-GPU tokens/s from the p4 file, FSDP2 on 2 GPUs (tokens/s and losses) from the p8 file
  python -m scripts.distributed_parity --out $A/parity-8gpu.json --gpus 8 --layouts fsdp2 --no-resume \
      --steps 12 --shape-steps 12 --recipes $S --baseline $A/parity-2gpu-p4.json,$A/parity-2gpu-p8.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from core.config import load_config
from core.distributed import SAFE_COLLECTIVES_ENV
from lifecycle import run_files
from verification.launch import free_port, log_tail, run_logged
from verification.provenance import provenance

DEFAULT_RECIPES = "recipes/smoke.yaml,recipes/bench-qwen2_5_vl-3b-shape.yaml"
FAST = "bf16-compiled"
LAYOUTS = ("single", FAST, "ddp", "fsdp2")  # what --layouts may name, in launch order
DEFAULT_LAYOUTS = ("single", "ddp", "fsdp2")
# The reference path every layout runs unless told otherwise (before the user's overrides, which may change it):
# eager blocks, fp32 module weights under autocast, transformers' Conv3d patch embedding.
REFERENCE_PATH = ["train.compile=false", "train.master_weights=module", "kernels.patch_embed=conv"]
# The fast layout: the one-GPU path a recipe ships with (trainer/defaults.py), set explicitly; after the user's
LAYOUT_OVERRIDES = {FAST: ["train.master_weights=optimizer", "train.compile=true", "kernels.patch_embed=matmul"]}
REPEAT = "single-repeat"  # the single layout launched again (--repeat-single): the reference's own run-to-run noise
FAST_REPEAT = f"{FAST}-repeat"  # the fast layout launched again (--repeat-fast): another draw of its gap
ONE_GPU_LAYOUTS = ("single", REPEAT, FAST, FAST_REPEAT)
GRAD_NORM_TOL = 1e-2  # bf16 parameters under FSDP2 move the step-1 gradient norm in its third digit (docs/numerics.md)
NOISE_MULTIPLE = 2.0
"""With --repeat-single, a loss curve is within noise when its largest per-step gap to the 1-GPU run is at most this
many times the gap between the 1-GPU run and its repeat (or --loss-tol, if larger). That gap is one draw: a layout with
the same noise exceeds it about half the time: scripts/curve_spread.py pools draws into an exact test instead."""
ACCELERATE_CONFIG = {"ddp": "ddp", "fsdp2": "fsdp2", "resume": "fsdp2"}  # layout → recipes/accelerate/<name>.yaml
LEGACY_PACKS_PER_STEP = 2  # what every --out file written before --packs-per-step existed ran
TEARDOWN_GRACE_S = 60  # a rank still alive this long after summary.json is stuck in teardown, not working


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--recipes", default=DEFAULT_RECIPES, help="comma list; the first is the small one")
    parser.add_argument("--gpus", type=int, default=2, help="processes of the multi-GPU layouts")
    parser.add_argument(
        "--layouts",
        default=",".join(DEFAULT_LAYOUTS),
        help=f"comma list, a subset of {','.join(LAYOUTS)} (run in that order)",
    )
    parser.add_argument(
        "--packs-per-step",
        type=int,
        default=None,
        help="packs of one optimizer step, a multiple of --gpus (default --gpus)",
    )
    parser.add_argument(
        "--baseline", default="", help="comma list of --out files of earlier runs to compare with (later ones win)"
    )
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps for the first recipe")
    parser.add_argument("--shape-steps", type=int, default=16, help="optimizer steps for the other recipes")
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from tokens/s")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume-all", action="store_true", help="FSDP2 resume check on every recipe, not just the first"
    )
    resume.add_argument("--no-resume", action="store_true", help="no FSDP2 resume check")
    parser.add_argument("--loss-tol", type=float, default=0.05, help="max |Δloss| per step that counts as parity")
    parser.add_argument(
        "--repeat-single",
        action="store_true",
        help=f"launch the single layout twice: losses within {NOISE_MULTIPLE:g}x its run-to-run gap count as parity",
    )
    parser.add_argument(
        "--repeat-fast", action="store_true", help=f"launch {FAST} twice: two draws of its gap to the 1-GPU run"
    )
    parser.add_argument(
        "--fast-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a dotted override for the {FAST} launches alone (repeatable), after the user's and its own",
    )
    parser.add_argument(
        "--grad-norm-tol",
        type=float,
        default=GRAD_NORM_TOL,
        help="max relative gap of the step-1 gradient norm to the 1-GPU run's (same weights, same packs)",
    )
    parser.add_argument("--launch-timeout", type=int, default=300, help="seconds one launch may take")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every run")
    args = parser.parse_args(argv)

    args.layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = sorted(set(args.layouts) - set(LAYOUTS))
    if unknown or not args.layouts or len(set(args.layouts)) != len(args.layouts):
        parser.error(f"--layouts takes distinct names from {','.join(LAYOUTS)}, got {','.join(args.layouts)!r}.")
    args.layouts = [name for name in LAYOUTS if name in args.layouts]
    if args.repeat_single and "single" not in args.layouts:
        parser.error("--repeat-single needs single in --layouts.")
    if (args.repeat_fast or args.fast_override) and FAST not in args.layouts:
        parser.error(f"--repeat-fast and --fast-override need {FAST} in --layouts.")
    if any("=" not in item or item.startswith("=") for item in args.fast_override):
        parser.error(f"--fast-override takes dotted.key=value, got {args.fast_override}.")
    args.baseline = [path.strip() for path in args.baseline.split(",") if path.strip()]
    if args.gpus < 2:
        parser.error(f"--gpus must be >= 2 (the multi-GPU layouts' process count), got {args.gpus}.")
    if args.packs_per_step is None:
        args.packs_per_step = args.gpus
    if args.packs_per_step < args.gpus or args.packs_per_step % args.gpus:
        parser.error(f"--packs-per-step must be a multiple of --gpus ({args.gpus}), got {args.packs_per_step}.")
    return args


def num_processes(layout: str, gpus: int) -> int:
    return 1 if layout in ONE_GPU_LAYOUTS else gpus


def command_for(layout: str, gpus: int, port: int) -> list[str]:
    """The launcher of one layout, train.py's own arguments to follow: `python train.py` for single, otherwise
    `accelerate launch` of `gpus` processes with the layout's accelerate config, rendezvous on `port`."""
    if layout in ONE_GPU_LAYOUTS:
        return [sys.executable, "train.py"]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        f"recipes/accelerate/{ACCELERATE_CONFIG[layout]}.yaml",
        "--num_processes",
        str(gpus),
        "--main_process_port",
        str(port),
        "train.py",
    ]


def micro_steps(layout: str, gpus: int, packs_per_step: int) -> int:
    """Accumulation micro-steps per optimizer step of each rank, so that the layout's ranks share packs_per_step."""
    return packs_per_step // num_processes(layout, gpus)


def micro_step_overrides(layout: str, gpus: int, packs_per_step: int) -> list[str]:
    """The layout's accumulation and the loader's balance window, equal, so one window is one optimizer step."""
    count = micro_steps(layout, gpus, packs_per_step)
    return [f"train.grad_accum_steps={count}", f"packing.balance_window_steps={count}"]


def common_overrides(args: argparse.Namespace, steps: int) -> list[str]:
    """Overrides of every launch of one recipe: its step count, per-step logging, no eval, a fresh start, the
    reference path (REFERENCE_PATH); then the user's own."""
    return [
        *REFERENCE_PATH,
        f"train.max_steps={steps}",
        f"logging.timing_warmup_steps={args.warmup}",
        "logging.every_steps=1",
        "logging.report_to=none",
        "logging.progress_bar=false",
        "train.eval_every=0",
        "checkpoint.resume=null",
        *args.overrides,
    ]


def launch_plan(args: argparse.Namespace, steps: int, with_resume: bool) -> dict[str, list[str]]:
    """train.py overrides of each layout in --layouts, in launch order (with --repeat-single, single's again right
    after it; with --repeat-fast, the fast layout's likewise; --fast-override items last in the fast layout's).
    With `with_resume`, fsdp2 checkpoints halfway and exports at the end for the resume check (planned by
    check_resume, which needs that checkpoint)."""
    no_checkpoints = ["checkpoint.every_steps=0", "checkpoint.save_final=false", "checkpoint.export=false"]
    halfway = [f"checkpoint.every_steps={steps // 2}", "checkpoint.keep_last=2", "checkpoint.save_final=false"]
    plan = {}
    for layout in args.layouts:
        checkpoints = [*halfway, "checkpoint.export=true"] if layout == "fsdp2" and with_resume else no_checkpoints
        plan[layout] = [
            *common_overrides(args, steps),
            *micro_step_overrides(layout, args.gpus, args.packs_per_step),
            *checkpoints,
            *LAYOUT_OVERRIDES.get(layout, []),
            *(args.fast_override if layout == FAST else []),
        ]
        if layout == "single" and args.repeat_single:
            plan[REPEAT] = plan[layout]
        if layout == FAST and args.repeat_fast:
            plan[FAST_REPEAT] = plan[layout]
    return plan


def launch(layout: str, recipe: str, run_dir: Path, overrides: list[str], gpus: int, timeout: int) -> dict:
    """One train.py launch; returns {"summary", "losses" and "grad_norms" (step → value), "wall_s",
    "teardown_hang"}; raises on failure or timeout."""
    run_dir.mkdir(parents=True, exist_ok=True)
    run_files.clear_results(run_dir)
    command = [*command_for(layout, gpus, free_port()), "--config", recipe, *overrides, f"train.output_dir={run_dir}"]
    env = dict(os.environ)
    if layout in ONE_GPU_LAYOUTS:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    print(f"[parity] {layout}: {shlex.join(command)}", flush=True)
    log_path = run_dir / "train.log"
    # summary.json appears once every rank is done (it needs their reductions): a rank still alive TEARDOWN_GRACE_S
    # later hangs in teardown and is killed.
    outcome = run_logged(
        command,
        log_path,
        timeout,
        env=env,
        done_file=run_dir / run_files.SUMMARY_FILE,
        teardown_grace_s=TEARDOWN_GRACE_S,
        new_session=True,
    )
    code = "timeout" if outcome.code is None else outcome.code
    teardown_hang, wall = outcome.hung_in_teardown, outcome.wall_s
    if code != 0 and not teardown_hang:
        raise RuntimeError(
            f"{layout} run of {recipe} ended with {code} after {wall:.0f} s; {log_path}:\n{log_tail(log_path, 25)}"
        )
    summary = run_files.read_summary(run_dir)
    records = run_files.read_metrics(run_dir)
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    grad_norms = {r["step"]: r["grad_norm"] for r in records if "grad_norm" in r}
    print(
        f"[parity] {layout}: {wall:.0f} s, {summary['num_processes']} process(es), "
        f"{summary['tokens_per_s_per_gpu'] or 0:,.0f} tokens/s/GPU, peak {summary['peak_mem_gib']} GiB",
        flush=True,
    )
    if teardown_hang:
        print(f"[parity] {layout}: finished its work but hung in process teardown; killed (see open problems)")
    return {
        "summary": summary,
        "losses": losses,
        "grad_norms": grad_norms,
        "wall_s": wall,
        "teardown_hang": teardown_hang,
    }


def max_gap(a: dict[int, float], b: dict[int, float]) -> float | None:
    common = sorted(set(a) & set(b))
    return max(abs(a[s] - b[s]) for s in common) if common else None


def first_step_gap(a: dict[int, float], b: dict[int, float]) -> float | None:
    """Relative gap of step 1's values (the gradient norm before any update: same weights, same packs), if both
    runs logged step 1."""
    return abs(a[1] - b[1]) / abs(b[1]) if 1 in a and 1 in b and b[1] else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def check_recipe(
    recipe: str, steps: int, args: argparse.Namespace, out_root: Path, with_resume: bool, baseline: dict | None
) -> dict:
    cfg = load_config(recipe, args.overrides)
    if cfg.train.grad_accum_steps != 1:
        raise ValueError(
            f"{recipe}: train.grad_accum_steps must be 1 here (each layout accumulates --packs-per-step / ranks)."
        )
    name = Path(recipe).stem
    runs, errors = {}, {}
    for layout, overrides in launch_plan(args, steps, with_resume).items():
        try:
            runs[layout] = launch(layout, recipe, out_root / name / layout, overrides, args.gpus, args.launch_timeout)
        except RuntimeError as error:  # e.g. out of memory in one layout: the others are still worth measuring
            errors[layout] = str(error)
            print(f"[parity] {layout} FAILED: {str(error)[:2000]}", flush=True)
    result = summarize(recipe, steps, args, runs, errors, baseline)
    if with_resume and "fsdp2" in runs:
        try:
            result["fsdp2_resume"] = check_resume(recipe, runs["fsdp2"], steps, args, out_root / name)
        except RuntimeError as error:
            errors["resume"] = str(error)
            print(f"[parity] resume FAILED: {str(error)[:2000]}", flush=True)
    return result


def summarize(
    recipe: str, steps: int, args: argparse.Namespace, runs: dict[str, dict], errors: dict, baseline: dict | None
) -> dict:
    """One recipe's JSON result from its launches (launch's dicts by layout) and the baseline's layouts for the
    same recipe (one entry of load_baseline's answer, or None). The 1-GPU reference is this run's single layout,
    else the baseline's; a baseline layout's losses are compared only when it trained on the same packs as this
    run (same steps, packs per step and overrides), its tokens/s always. The 1-GPU run's gap to its repeat
    (--repeat-single here, else the baseline's of the same packs) is the result's `noise_max_abs_dloss`
    (`loss_tolerance`)."""

    def same_packs(row: dict) -> bool:
        return (row["steps"], row["packs_per_step"], row["overrides"]) == (steps, args.packs_per_step, args.overrides)

    baseline = baseline or {}
    if "single" in runs:
        single = runs["single"]
        one_gpu = {
            "tokens_per_s_per_gpu": single["summary"]["tokens_per_s_per_gpu"],
            "losses": single["losses"],
            "grad_norms": single["grad_norms"],
            "source": "this run",
        }
    elif "single" in baseline:
        row = baseline["single"]
        one_gpu = {
            "tokens_per_s_per_gpu": row["tokens_per_s_per_gpu"],
            "losses": row["losses"] if same_packs(row) else {},  # other packs: its tokens/s count, its losses not
            "grad_norms": row["grad_norms"] if same_packs(row) else {},
            "source": "baseline",
        }
    else:
        one_gpu = None

    result = {"recipe": recipe, "steps": steps, "packs_per_step": args.packs_per_step, "layouts": {}}
    for layout, run in runs.items():
        summary, losses = run["summary"], run["losses"]
        tps = summary["tokens_per_s_per_gpu"]
        reference = one_gpu if layout != "single" else None
        twin = baseline.get(layout)
        result["layouts"][layout] = {
            "num_processes": summary["num_processes"],
            "grad_accum_steps": micro_steps(layout, args.gpus, args.packs_per_step),
            "tokens_per_s_per_gpu": tps,
            "scaling_efficiency": ratio(tps, reference["tokens_per_s_per_gpu"]) if reference else None,
            "mfu": summary["mfu"],
            "peak_mem_gib_rank0": summary["peak_mem_gib"],
            "loss_end": summary["loss_end"],
            "max_abs_dloss_vs_single": max_gap(losses, reference["losses"]) if reference else None,
            "step1_grad_norm_rel_vs_single": first_step_gap(run["grad_norms"], reference["grad_norms"])
            if reference
            else None,
            "single_from": reference["source"] if reference else None,
            "vs_baseline": None
            if twin is None
            else {
                "num_processes": twin["num_processes"],
                "scaling_efficiency": ratio(tps, twin["tokens_per_s_per_gpu"]),
                "max_abs_dloss": max_gap(losses, twin["losses"]) if same_packs(twin) else None,
            },
            "teardown_hang": run["teardown_hang"],
            "wall_s": run["wall_s"],
            "losses": losses,
            "grad_norms": run["grad_norms"],
        }
    if REPEAT in result["layouts"]:
        result["noise_max_abs_dloss"] = result["layouts"][REPEAT]["max_abs_dloss_vs_single"]
    elif {"single", REPEAT} <= baseline.keys() and same_packs(baseline["single"]) and same_packs(baseline[REPEAT]):
        result["noise_max_abs_dloss"] = max_gap(baseline[REPEAT]["losses"], baseline["single"]["losses"])
    result["errors"] = errors
    lent_single = one_gpu is not None and one_gpu["source"] == "baseline"
    used = [layout for layout in baseline if layout in runs or (layout == "single" and lent_single)]
    if used:
        result["baseline"] = {
            layout: {
                "path": baseline[layout]["path"],
                "steps": baseline[layout]["steps"],
                "packs_per_step": baseline[layout]["packs_per_step"],
                "losses_compared": same_packs(baseline[layout]),
            }
            for layout in used
        }
    return result


def load_baseline(paths: list[str]) -> dict[str, dict[str, dict]]:
    """Earlier --out files' layouts by recipe file name (stem) and layout, each as {"path", "steps",
    "packs_per_step", "overrides" (None where the file predates them), "num_processes", "tokens_per_s_per_gpu",
    "losses" and "grad_norms" (int step → value; no grad norms in files written before they were recorded)}.
    Files are read in order; a recipe's layout in a later file replaces the earlier."""
    baselines: dict[str, dict[str, dict]] = {}
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
            results = report["results"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"--baseline {path}: not a distributed_parity.py --out file ({error!r}).") from error
        for result in results:
            layouts = baselines.setdefault(Path(result["recipe"]).stem, {})
            for layout, row in result["layouts"].items():
                layouts[layout] = {
                    "path": path,
                    "steps": result["steps"],
                    "packs_per_step": result.get("packs_per_step", LEGACY_PACKS_PER_STEP),
                    "overrides": report.get("overrides"),
                    "num_processes": row["num_processes"],
                    "tokens_per_s_per_gpu": row["tokens_per_s_per_gpu"],
                    "losses": {int(step): loss for step, loss in row["losses"].items()},
                    "grad_norms": {int(step): norm for step, norm in row.get("grad_norms", {}).items()},
                }
    return baselines


def check_resume(recipe: str, full: dict, steps: int, args: argparse.Namespace, root: Path) -> dict:
    """FSDP2 relaunched from the halfway checkpoint must log the same losses afterwards; its export must load."""
    half = steps // 2
    checkpoint = Path(full["summary"]["run_dir"]) / "checkpoints" / f"step_{half:08d}"
    overrides = [
        *common_overrides(args, steps),
        *micro_step_overrides("resume", args.gpus, args.packs_per_step),
        f"checkpoint.resume={checkpoint}",
        "checkpoint.every_steps=0",
        "checkpoint.save_final=false",
        "checkpoint.export=false",
    ]
    resumed = launch("resume", recipe, root / "fsdp2-resumed", overrides, args.gpus, args.launch_timeout)
    after = {s: loss for s, loss in full["losses"].items() if s > half}
    export_dir = full["summary"]["export_dir"]
    return {
        "checkpoint": str(checkpoint),
        "steps_compared": sorted(set(after) & set(resumed["losses"])),
        "max_abs_dloss": max_gap(after, resumed["losses"]),
        "export_dir": export_dir,
        "export_loads_on_cpu": export_loads(export_dir),
    }


def export_loads(export_dir: str | None) -> str:
    """'ok' when the FSDP2 run's export loads on the CPU with every weight present, else what went wrong."""
    if export_dir is None:
        return "no export written"
    from transformers import AutoModelForImageTextToText

    try:
        _, info = AutoModelForImageTextToText.from_pretrained(export_dir, output_loading_info=True, device_map="cpu")
    except Exception as error:  # reported in the JSON, not fatal: the other numbers are still worth having
        return f"failed: {type(error).__name__}: {error}"
    missing, unexpected = info["missing_keys"], info["unexpected_keys"]
    return (
        "ok"
        if not missing and not unexpected
        else f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
    )


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _verdict(gap: float | None, tol: float) -> str:
    return "" if gap is None else (" ✓" if gap <= tol else " ✗")


def loss_tolerance(result: dict, tol: float) -> float:
    """The largest per-step |Δloss| that counts as parity for one recipe: `tol` (--loss-tol), or NOISE_MULTIPLE ×
    the 1-GPU run's gap to its own repeat (--repeat-single) where that is larger. Where the reference itself does
    not reproduce (non-deterministic kernels, a training phase that amplifies them), a fixed tolerance would fail
    layouts for the reference's own noise."""
    noise = result.get("noise_max_abs_dloss")
    return tol if noise is None else max(tol, NOISE_MULTIPLE * noise)


def table(results: list[dict], tol: float, grad_norm_tol: float = GRAD_NORM_TOL) -> str:
    """Markdown table of the results; "(baseline)" marks a 1-GPU reference taken from --baseline, and the
    baseline columns (only when one was given) name the baseline layout's GPU count. Loss gaps are judged at
    `loss_tolerance`; the repeat's own gap is the noise that sets it."""
    with_baseline = any("baseline" in result for result in results)
    header = (
        "| recipe | layout | GPUs | micro-steps | tokens/s/GPU | scaling vs 1 GPU | MFU | peak mem rank 0 (GiB) "
        "| step-1 grad norm Δ (rel) | max \\|Δloss\\| vs 1 GPU |"
    )
    rule = "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    if with_baseline:
        header += " scaling vs baseline | max \\|Δloss\\| vs baseline |"
        rule += "---:|---:|"
    lines = [header, rule]
    for result in results:
        loss_tol = loss_tolerance(result, tol)
        for layout, row in result["layouts"].items():
            gap = row["max_abs_dloss_vs_single"]
            verdict = " (noise)" if layout == REPEAT and gap is not None else _verdict(gap, loss_tol)
            norm_gap = row.get("step1_grad_norm_rel_vs_single")
            mfu = None if row["mfu"] is None else 100 * row["mfu"]
            source = " (baseline)" if row["single_from"] == "baseline" and row["scaling_efficiency"] else ""
            line = (
                f"| {Path(result['recipe']).stem} | {layout} | {row['num_processes']} | {row['grad_accum_steps']} "
                f"| {_fmt(row['tokens_per_s_per_gpu'], ',.0f')} | {_fmt(row['scaling_efficiency'], '.1%')}{source} "
                f"| {_fmt(mfu, '.1f')} | {_fmt(row['peak_mem_gib_rank0'], '.1f')} "
                f"| {_fmt(norm_gap, '.1e')}{_verdict(norm_gap, grad_norm_tol)} | {_fmt(gap, '.2e')}{verdict} |"
            )
            if with_baseline:
                twin = row["vs_baseline"] or {}
                gpus = twin.get("num_processes")
                of = f" vs {gpus} GPU{'s' * (gpus > 1)}" if twin else ""
                twin_gap = twin.get("max_abs_dloss")
                line += (
                    f" {_fmt(twin.get('scaling_efficiency'), '.1%')}{of} "
                    f"| {_fmt(twin_gap, '.2e')}{_verdict(twin_gap, loss_tol)} |"
                )
            lines.append(line)
    return "\n".join(lines)


def passed(result: dict, tol: float, grad_norm_tol: float = GRAD_NORM_TOL) -> bool:
    """Every compared loss curve within `loss_tolerance`, every step-1 gradient norm within `grad_norm_tol` of the
    1-GPU run's, the resume check (if any) reproduced and exported, no launch failed."""
    rows = [row for layout, row in result["layouts"].items() if layout != REPEAT]
    gaps = [row["max_abs_dloss_vs_single"] for row in rows]
    gaps += [row["vs_baseline"]["max_abs_dloss"] for row in rows if row["vs_baseline"]]
    norm_gaps = [row.get("step1_grad_norm_rel_vs_single") for row in rows]
    resume = result.get("fsdp2_resume")
    if resume:
        gaps.append(resume["max_abs_dloss"] or 0.0)
        if resume["export_loads_on_cpu"] != "ok":
            return False
    loss_tol = loss_tolerance(result, tol)
    return (
        not result["errors"]
        and all(gap is None or gap <= loss_tol for gap in gaps)
        and all(gap is None or gap <= grad_norm_tol for gap in norm_gaps)
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    baselines = load_baseline(args.baseline)
    import torch

    gpus_needed = max(num_processes(layout, args.gpus) for layout in args.layouts)
    if torch.cuda.device_count() < gpus_needed:
        sys.exit(f"[parity] needs {gpus_needed} GPUs, found {torch.cuda.device_count()}.")
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    out = Path(args.out)
    out_root = out.parent / "runs" / out.stem  # one tree per --out file: a later run keeps an earlier one's logs
    start = time.perf_counter()
    results = []
    for index, recipe in enumerate(recipes):
        steps = args.steps if index == 0 else args.shape_steps
        with_resume = "fsdp2" in args.layouts and not args.no_resume and (index == 0 or args.resume_all)
        baseline = baselines.get(Path(recipe).stem)
        if args.baseline and baseline is None:
            print(f"[parity] --baseline has no result for {Path(recipe).stem}: no baseline columns for it.")
        results.append(check_recipe(recipe, steps, args, out_root, with_resume, baseline))
    report = {
        "provenance": provenance(),
        "gpus": args.gpus,
        "layouts": args.layouts,
        "packs_per_step": args.packs_per_step,
        "overrides": args.overrides,
        "baseline": args.baseline,
        "loss_tol": args.loss_tol,
        "grad_norm_tol": args.grad_norm_tol,
        "repeat_single": args.repeat_single,
        "repeat_fast": args.repeat_fast,
        "fast_overrides": args.fast_override,
        "env": SAFE_COLLECTIVES_ENV,
        "results": results,
        "wall_s": time.perf_counter() - start,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("\n" + table(results, args.loss_tol, args.grad_norm_tol))
    for result in results:
        name = Path(result["recipe"]).stem
        noise = result.get("noise_max_abs_dloss")
        if noise is not None:
            print(
                f"\n{name}: the 1-GPU run and its repeat differ by up to {noise:.2e} per step; losses within "
                f"{loss_tolerance(result, args.loss_tol):.2e} (max of --loss-tol, {NOISE_MULTIPLE:g}x that) pass; "
                "scripts/curve_spread.py judges one layout over several such draws."
            )
        resume = result.get("fsdp2_resume")
        if resume:
            print(
                f"\nFSDP2 resume ({name}): steps {resume['steps_compared']}, max |Δloss| "
                f"{_fmt(resume['max_abs_dloss'], '.2e')}; export on CPU: {resume['export_loads_on_cpu']}"
            )
        for layout, base in result.get("baseline", {}).items():
            if not base["losses_compared"]:
                print(
                    f"\n{name}: losses not compared with the baseline's {layout} ({base['path']}): it ran "
                    f"{base['steps']} steps of {base['packs_per_step']} packs (this run: {result['steps']} of "
                    f"{result['packs_per_step']}), or other (or unrecorded) overrides."
                )
        for layout in result["errors"]:
            print(f"\n{name} {layout}: FAILED (see the JSON and its train.log)")
    print(f"\n[parity] {report['wall_s']:.0f} s in all; wrote {out}")
    return 0 if all(passed(result, args.loss_tol, args.grad_norm_tol) for result in results) else 1
