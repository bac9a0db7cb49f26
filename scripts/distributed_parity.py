"""Two GPUs against one on the same global batch: loss parity, tokens/s scaling, peak memory, FSDP2 resume/export.

    python scripts/distributed_parity.py --out artifacts/distributed/parity.json \
        [--recipes recipes/smoke.yaml,recipes/bench-qwen2_5_vl-3b-shape.yaml] [--steps 30] [--shape-steps 16] \
        [dotted.key=value ...]

For each recipe, separate launches of train.py (every one with NVLink multicast off, training/distributed.py):
  single   one GPU, two accumulation micro-batches per step          python train.py
  ddp      two GPUs, one micro-batch each                             accelerate launch … ddp.yaml
  fsdp2    two GPUs, sharded, with a checkpoint halfway               accelerate launch … fsdp2.yaml
  resume   fsdp2 again from that checkpoint (first recipe only, or --resume-all), then its export loaded on the CPU
The three layouts see the same packs per optimizer step: the loader deals a window of two packs either to two ranks
(`packing.balance_window_steps=1`) or to two consecutive micro-steps of one rank (`=2`), and the loss is
normalised by the global label count, so the curves may differ only by reduction order in bf16.
Scaling efficiency = tokens/s per GPU on two GPUs ÷ tokens/s on one (train.py's mean after the warm-up steps).
Prints a table and writes every number (and the per-step losses) as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.config import load_config  # noqa: E402
from training.distributed import SAFE_COLLECTIVES_ENV, kill_process_tree  # noqa: E402

DEFAULT_RECIPES = "recipes/smoke.yaml,recipes/bench-qwen2_5_vl-3b-shape.yaml"
TEARDOWN_GRACE_S = 60  # a rank still alive this long after summary.json is stuck in teardown, not working
LAYOUT_WINDOW = {"single": 2, "ddp": 1, "fsdp2": 1, "resume": 1}  # packing.balance_window_steps per layout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--recipes", default=DEFAULT_RECIPES, help="comma list; the first is the small one")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps for the first recipe")
    parser.add_argument("--shape-steps", type=int, default=16, help="optimizer steps for the other recipes")
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from tokens/s")
    parser.add_argument(
        "--resume-all", action="store_true", help="FSDP2 resume check on every recipe, not just the first"
    )
    parser.add_argument("--loss-tol", type=float, default=0.05, help="max |Δloss| per step that counts as parity")
    parser.add_argument("--launch-timeout", type=int, default=300, help="seconds one launch may take")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every run")
    return parser.parse_args(argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command_for(layout: str) -> list[str]:
    if layout == "single":
        return [sys.executable, "train.py"]
    config = "ddp" if layout == "ddp" else "fsdp2"
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        f"recipes/accelerate/{config}.yaml",
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        "train.py",
    ]


def launch(layout: str, recipe: str, run_dir: Path, overrides: list[str], timeout: int) -> dict:
    """One train.py launch; returns {"summary", "losses" (step → loss), "wall_s", "teardown_hang"}; raises on
    failure or timeout."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "summary.json"):
        (run_dir / stale).unlink(missing_ok=True)
    command = [*command_for(layout), "--config", recipe, *overrides, f"train.output_dir={run_dir}"]
    env = {**os.environ, **SAFE_COLLECTIVES_ENV}
    if layout == "single":
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    print(f"[parity] {layout}: {shlex.join(command)}", flush=True)
    log_path = run_dir / "train.log"
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        code, teardown_hang = wait_for_run(proc, run_dir / "summary.json", timeout)
    wall = time.perf_counter() - start
    if code != 0 and not teardown_hang:
        tail = "\n".join(log_path.read_text().splitlines()[-25:])
        raise RuntimeError(f"{layout} run of {recipe} ended with {code} after {wall:.0f} s; {log_path}:\n{tail}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    print(
        f"[parity] {layout}: {wall:.0f} s, {summary['num_processes']} process(es), "
        f"{summary['tokens_per_s_per_gpu'] or 0:,.0f} tokens/s/GPU, peak {summary['peak_mem_gib']} GiB",
        flush=True,
    )
    if teardown_hang:
        print(f"[parity] {layout}: finished its work but hung in process teardown; killed (see open problems)")
    return {"summary": summary, "losses": losses, "wall_s": wall, "teardown_hang": teardown_hang}


def wait_for_run(proc: subprocess.Popen, summary: Path, timeout: int) -> tuple[int | str, bool]:
    """Wait for a launch; kill its process group after `timeout` s, or TEARDOWN_GRACE_S after its summary.json
    appeared (all ranks are done by then: the summary needs their reductions) if a rank never exits.
    Returns (exit code or "timeout", whether it was killed in teardown)."""
    deadline = time.monotonic() + timeout
    done_at = None
    while True:
        try:
            return proc.wait(timeout=2), False
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if done_at is None and summary.is_file():
                done_at = now
            hung_in_teardown = done_at is not None and now - done_at > TEARDOWN_GRACE_S
            if hung_in_teardown or now > deadline:
                kill_process_tree(proc.pid)
                proc.wait()
                return "timeout", hung_in_teardown


def max_gap(a: dict[int, float], b: dict[int, float]) -> float | None:
    common = sorted(set(a) & set(b))
    return max(abs(a[s] - b[s]) for s in common) if common else None


def check_recipe(recipe: str, steps: int, args: argparse.Namespace, out_root: Path, with_resume: bool) -> dict:
    cfg = load_config(recipe, args.overrides)
    if cfg.train.grad_accum_steps != 1:
        raise ValueError(f"{recipe}: train.grad_accum_steps must be 1 here (the one-GPU run accumulates 2 itself).")
    half = steps // 2
    common = [
        f"train.max_steps={steps}",
        f"logging.timing_warmup_steps={args.warmup}",
        "logging.every_steps=1",
        "logging.report_to=none",
        "logging.progress_bar=false",
        "train.eval_every=0",
        "checkpoint.resume=null",
    ]
    common += args.overrides
    no_checkpoints = ["checkpoint.every_steps=0", "checkpoint.save_final=false", "checkpoint.export=false"]
    halfway = [f"checkpoint.every_steps={half}", "checkpoint.keep_last=2", "checkpoint.save_final=false"]
    plan = {
        "single": ["train.grad_accum_steps=2", *no_checkpoints],
        "ddp": no_checkpoints,
        "fsdp2": [*halfway, "checkpoint.export=true"] if with_resume else no_checkpoints,
    }
    name = Path(recipe).stem
    runs, errors = {}, {}
    for layout, extra in plan.items():
        window = f"packing.balance_window_steps={LAYOUT_WINDOW[layout]}"
        try:
            runs[layout] = launch(
                layout, recipe, out_root / name / layout, [*common, window, *extra], args.launch_timeout
            )
        except RuntimeError as error:  # e.g. out of memory in one layout: the others are still worth measuring
            errors[layout] = str(error)
            print(f"[parity] {layout} FAILED: {str(error)[:2000]}", flush=True)

    single = runs.get("single")
    result = {"recipe": recipe, "steps": steps, "layouts": {}, "errors": errors}
    for layout, run in runs.items():
        summary = run["summary"]
        tps = summary["tokens_per_s_per_gpu"]
        base_tps = single["summary"]["tokens_per_s_per_gpu"] if single else None
        result["layouts"][layout] = {
            "num_processes": summary["num_processes"],
            "tokens_per_s_per_gpu": tps,
            "scaling_efficiency": tps / base_tps if layout != "single" and tps and base_tps else None,
            "mfu": summary["mfu"],
            "peak_mem_gib_rank0": summary["peak_mem_gib"],
            "loss_end": summary["loss_end"],
            "max_abs_dloss_vs_single": (
                max_gap(run["losses"], single["losses"]) if layout != "single" and single else None
            ),
            "teardown_hang": run["teardown_hang"],
            "wall_s": run["wall_s"],
            "losses": run["losses"],
        }
    if with_resume and "fsdp2" in runs:
        try:
            result["fsdp2_resume"] = check_resume(recipe, runs["fsdp2"], half, common, out_root / name, args)
        except RuntimeError as error:
            errors["resume"] = str(error)
            print(f"[parity] resume FAILED: {str(error)[:2000]}", flush=True)
    return result


def check_resume(recipe: str, full: dict, half: int, common: list[str], root: Path, args) -> dict:
    """FSDP2 relaunched from the halfway checkpoint must log the same losses afterwards; its export must load."""
    checkpoint = Path(full["summary"]["run_dir"]) / "checkpoints" / f"step_{half:08d}"
    overrides = [
        *common,
        f"packing.balance_window_steps={LAYOUT_WINDOW['resume']}",
        f"checkpoint.resume={checkpoint}",
        "checkpoint.every_steps=0",
        "checkpoint.save_final=false",
        "checkpoint.export=false",
    ]
    resumed = launch("resume", recipe, root / "fsdp2-resumed", overrides, args.launch_timeout)
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


def table(results: list[dict], tol: float) -> str:
    lines = [
        "| recipe | layout | GPUs | tokens/s/GPU | scaling vs 1 GPU | MFU | peak mem rank 0 (GiB) "
        "| max \\|Δloss\\| vs 1 GPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for layout, row in result["layouts"].items():
            gap = row["max_abs_dloss_vs_single"]
            verdict = "" if gap is None else (" ✓" if gap <= tol else " ✗")
            mfu = None if row["mfu"] is None else 100 * row["mfu"]
            lines.append(
                f"| {Path(result['recipe']).stem} | {layout} | {row['num_processes']} "
                f"| {_fmt(row['tokens_per_s_per_gpu'], ',.0f')} | {_fmt(row['scaling_efficiency'], '.1%')} "
                f"| {_fmt(mfu, '.1f')} | {_fmt(row['peak_mem_gib_rank0'], '.1f')} | {_fmt(gap, '.2e')}{verdict} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if torch.cuda.device_count() < 2:
        sys.exit(f"[parity] needs 2 GPUs, found {torch.cuda.device_count()}.")
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    out = Path(args.out)
    out_root = out.parent / "runs"
    start = time.perf_counter()
    results = []
    for index, recipe in enumerate(recipes):
        steps = args.steps if index == 0 else args.shape_steps
        results.append(check_recipe(recipe, steps, args, out_root, with_resume=index == 0 or args.resume_all))
    report = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "device": f"2x {torch.cuda.get_device_name(0)}",
        "torch": torch.__version__,
        "loss_tol": args.loss_tol,
        "env": SAFE_COLLECTIVES_ENV,
        "results": results,
        "wall_s": time.perf_counter() - start,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("\n" + table(results, args.loss_tol))
    ok = True
    for result in results:
        resume = result.get("fsdp2_resume")
        if resume:
            print(
                f"\nFSDP2 resume ({Path(result['recipe']).stem}): steps {resume['steps_compared']}, max |Δloss| "
                f"{_fmt(resume['max_abs_dloss'], '.2e')}; export on CPU: {resume['export_loads_on_cpu']}"
            )
            ok &= resume["export_loads_on_cpu"] == "ok" and (resume["max_abs_dloss"] or 0.0) <= args.loss_tol
        for row in result["layouts"].values():
            gap = row["max_abs_dloss_vs_single"]
            ok &= gap is None or gap <= args.loss_tol
        for layout in result["errors"]:
            print(f"\n{Path(result['recipe']).stem} {layout}: FAILED (see the JSON and its train.log)")
            ok = False
    print(f"\n[parity] {report['wall_s']:.0f} s in all; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
