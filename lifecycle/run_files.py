"""The run directory's files, written and read here only: metrics.jsonl, summary.json, config.yaml and
preempted.json (run.lock is lifecycle/run_lock.py's).

    <train.output_dir>/
      config.yaml      the resolved recipe of the first launch (lifecycle/resume.py adds config.resume-step<N>.yaml)
      metrics.jsonl    one JSON object per line: a training interval {"loss", "grad_norm", rates…, "step", "lr"}
                       or an evaluation {"step", "eval_loss"}, or with train.compile the launch's first step
                       {"step", "first_step_s", "compile_s"}; strict JSON (non-finite floats are null)
      summary.json     the whole run: losses, eval loss, mean rates over the timed steps, paths (`metrics.summarize`)
      run.lock         the live run's host and pid (empty when none runs): one trainer per directory
      preempted.json   present while the last launch stopped on a signal (SIGTERM, SIGINT) before the end: the
                       signal, the step, the checkpoint to resume from; gone once a launch starts again
      checkpoints/, final/, wandb/

Writes are atomic where a kill could tear them (summary.json, metrics.jsonl truncation on resume).
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.yaml"
LOCK_FILE = "run.lock"
PREEMPTED_FILE = "preempted.json"


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a kill leaves the old file or the new one, never a torn one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def json_line(record: dict) -> str:
    """`record` as strict JSON: a non-finite float (a rate over an empty interval) becomes null, never the NaN or
    Infinity tokens that json.dumps writes by default and JSON readers reject."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(clean, allow_nan=False)


def append_metrics(run_dir: Path, record: dict) -> None:
    with (run_dir / METRICS_FILE).open("a") as f:
        f.write(json_line(record) + "\n")


def read_metrics(run_dir: Path) -> list[dict]:
    """Every record of metrics.jsonl, in order ([] when there is none)."""
    metrics_file = run_dir / METRICS_FILE
    if not metrics_file.is_file():
        return []
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]


def training_records(run_dir: Path) -> list[dict]:
    """The training-interval records of metrics.jsonl (those with a loss), one per logged step."""
    return [r for r in read_metrics(run_dir) if "loss" in r]


def keep_metrics_through(run_dir: Path, step: int) -> None:
    """Keep metrics.jsonl's records of steps <= `step` (all of them for a fresh run: none): a resume from the
    checkpoint at `step` logs the later steps again, and each step must appear once. A line torn by a kill is
    dropped too."""
    metrics_file = run_dir / METRICS_FILE
    if not metrics_file.is_file():
        return
    kept = []
    for line in metrics_file.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            if json.loads(line).get("step", 0) <= step:
                kept.append(line + "\n")
    write_atomically(metrics_file, "".join(kept))


def write_summary(run_dir: Path, summary: dict) -> None:
    write_atomically(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2, allow_nan=False) + "\n")


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / SUMMARY_FILE).read_text())


def has_summary(run_dir: Path) -> bool:
    return (run_dir / SUMMARY_FILE).is_file()


def clear_results(run_dir: Path) -> None:
    """Remove metrics.jsonl and summary.json, so that a rerun into the same directory never reads old numbers."""
    for name in (METRICS_FILE, SUMMARY_FILE):
        (run_dir / name).unlink(missing_ok=True)


def write_preempted(run_dir: Path, record: dict) -> None:
    """Record that this launch stopped on a signal (a requeue script tests for the file: launchers such as
    `accelerate launch` report their ranks' exit status as 1)."""
    write_atomically(run_dir / PREEMPTED_FILE, json.dumps(record, indent=2) + "\n")


def clear_preempted(run_dir: Path) -> None:
    (run_dir / PREEMPTED_FILE).unlink(missing_ok=True)
