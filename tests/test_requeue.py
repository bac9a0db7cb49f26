"""A run requeued on another number of processes (lifecycle/trusted_resume.py, data/pipeline.py's StepLoader): refused
in one line on every rank without --allow-world-size-change; with it, the model and optimizer continue as saved and
the epoch goes on with the packs the saved run had not taken, none repeated and none left out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from core.distributed import HostCollectives
from lifecycle import run_files, trusted_resume
from tests.test_data_pipeline import SyntheticItems, synthetic_loader
from tests.test_distributed import COMMON, TINY, launch, run_processes, write_mixed_dataset
from verification.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = 61  # 31 packs of synthetic_loader an epoch: no layout here divides them evenly


def epoch_rest(loaders) -> list[tuple]:
    """The batches each of `loaders` (one per rank, all at the same position) yields until its epoch ends."""
    epoch, batches = loaders[0].epoch, []
    iterators = [iter(loader) for loader in loaders]
    while True:
        step = [next(iterator) for iterator in iterators]
        if loaders[0].epoch != epoch:
            return batches
        batches += step


def take(loaders, steps: int) -> tuple[list[tuple], dict]:
    """`steps` micro-steps of every rank's loader: (their batches, the position rank 0 would save)."""
    iterators = [iter(loader) for loader in loaders]
    batches = [next(iterator) for _ in range(steps) for iterator in iterators]
    return batches, loaders[0].state_dict()


def layout(world_size: int, grad_accum_steps: int, window: int):
    return [synthetic_loader(SAMPLES, rank, world_size, grad_accum_steps, window) for rank in range(world_size)]


@pytest.mark.parametrize(
    "layouts",
    [
        [(2, 1, 2, 6), (1, 2, 1, None)],  # two ranks -> one rank accumulating two micro-steps
        [(1, 2, 1, 6), (2, 1, 2, None)],  # one -> two
        [(3, 1, 1, 3), (2, 2, 3, None)],  # three -> two, other windows and accumulation
        [(2, 1, 2, 4), (1, 2, 1, 6), (3, 1, 1, None)],  # requeued twice within one epoch
        [(1, 1, 1, 31), (2, 1, 1, None)],  # stopped after the epoch's last step: nothing left of it
    ],
)
def test_a_changed_process_count_continues_the_epoch_without_repeating_or_dropping_a_sample(layouts):
    """(world size, grad_accum_steps, balance_window_steps, micro-steps taken) per launch: the samples of the epoch
    taken before each change and after the last are disjoint, and the samples no launch took are exactly the tokens
    the last launch's plan reports as left over (counted, as every epoch's end is)."""
    taken, state = [], None
    for world, accum, window, steps in layouts:
        loaders = layout(world, accum, window)
        if state is not None:
            for loader in loaders:
                loader.load_state_dict(state)
        if steps is None:
            leftover = loaders[0].leftover(0)
            taken += epoch_rest(loaders)
        else:
            batches, state = take(loaders, steps)
            taken += batches
    keys = [key for batch in taken for key in batch]
    assert len(keys) == len(set(keys)), "a sample of the epoch was repeated"
    sizes = SyntheticItems(SAMPLES).sizes
    missing = set(range(SAMPLES)) - set(keys)
    assert sum(sizes[key][0] for key in missing) == leftover.tokens, "a sample was left out without being counted"
    assert leftover.packs <= layouts[-1][0] * layouts[-1][1]


def test_the_epochs_after_a_carried_one_are_planned_as_usual():
    """After the carried epoch, a loader resumed from another process count yields what a loader that always ran on
    its layout yields for the next epoch, and its saved position no longer carries the old layout's steps."""
    _, state = take(layout(2, 1, 2), 5)
    resumed = layout(1, 2, 1)
    resumed[0].load_state_dict(state)
    epoch_rest(resumed)
    assert resumed[0].state_dict()["carried"] == []
    fresh = layout(1, 2, 1)
    epoch_rest(fresh)
    assert epoch_rest(resumed) == epoch_rest(fresh)


def test_the_same_process_count_resumes_the_position_unchanged():
    """A position saved and loaded on one layout continues the plan exactly (the carried list stays empty)."""
    _, state = take(layout(2, 1, 2), 3)
    again = layout(2, 1, 2)
    for loader in again:
        loader.load_state_dict(state)
    reference = layout(2, 1, 2)
    take(reference, 3)
    assert again[0].state_dict() == state and state["carried"] == []
    assert epoch_rest(again) == epoch_rest(reference)


def write_checkpoint(directory: Path, processes: int, plain_marker: bool = False) -> Path:
    """A checkpoint directory whose marker records `processes` (or, `plain_marker`, only per-rank state files)."""
    directory.mkdir(parents=True)
    for rank in range(processes):
        (directory / f"trainer_state_rank{rank}.pt").write_bytes(b"")
    record = "2\n" if plain_marker else json.dumps({"step": 2, "num_processes": processes, "files": {}})
    (directory / "COMPLETE").write_text(record)
    return directory


@pytest.mark.parametrize("plain_marker", [False, True])
def test_another_process_count_is_refused_naming_both_counts_and_the_flag(tmp_path, caplog, plain_marker):
    """Without the flag: a one-line CheckpointError with the saved and the launched count and the flag, for a marker
    that records the count and for an older plain one (counted from its state files), also from `latest`; with the
    flag the checkpoint is chosen, with a warning."""
    saved = write_checkpoint(tmp_path / "checkpoints" / "step_00000002", 2, plain_marker)
    trusted_resume.check_processes(saved, 2, allow_change=False)
    with pytest.raises(trusted_resume.CheckpointError) as refused:
        trusted_resume.check_processes(saved, 1, allow_change=False)
    message = str(refused.value)
    assert "\n" not in message
    assert "saved by 2 processes and this launch has 1" in message and "--allow-world-size-change" in message
    one_process = HostCollectives(SimpleNamespace(num_processes=1))
    with pytest.raises(trusted_resume.CheckpointError, match="saved by 2 processes and this launch has 1"):
        trusted_resume.choose("latest", tmp_path, one_process, rank=0)
    with caplog.at_level("WARNING"):
        assert trusted_resume.choose("latest", tmp_path, one_process, rank=0, allow_world_size_change=True) == saved
    assert "saved by 2 processes, on 1 (--allow-world-size-change)" in caplog.text


# ----- end to end: two processes (gloo on CPU) and one -----


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory) -> dict[str, Path]:
    """A 4-step run on two processes and one on one process (checkpoints at steps 2 and 4), same data and recipe."""
    root = tmp_path_factory.mktemp("requeue")
    data, cache = write_mixed_dataset(root / "data"), root / "cache"
    launch(2, root / "two", data, cache, "packing.balance_window_steps=1", "checkpoint.export=false")
    launch(1, root / "one", data, cache, "packing.balance_window_steps=1", "checkpoint.export=false")
    return {"two": root / "two", "one": root / "one", "data": data, "cache": cache}


def requeued(run: Path, into: Path) -> Path:
    """A copy of `run` as a requeue finds it after a stop at step 2: its step-2 checkpoint and steps 1-2 logged."""
    shutil.copytree(run, into, ignore=shutil.ignore_patterns("step_00000004", "summary.json", "run.lock"))
    records = [r for r in run_files.training_records(run) if r["step"] <= 2]
    (into / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return into


def resume_command(nproc: int, run: Path, runs: dict[str, Path], *flags: str) -> list[str]:
    args = ["train.py", "--config", TINY, *COMMON, f"data.path={runs['data']}", f"data.cache_dir={runs['cache']}"]
    args += [f"train.output_dir={run}", "packing.balance_window_steps=1", "checkpoint.export=false", "--resume"]
    command = [sys.executable, *args, *flags]
    if nproc > 1:
        launcher = ["-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/ddp.yaml"]
        command[1:1] = [*launcher, f"--num_processes={nproc}", f"--main_process_port={free_port()}"]
    return command


def rank_tracebacks(output: str) -> list[str]:
    """The tracebacks in a launch's output but the launcher's own report that a rank exited non-zero (torch's
    elastic agent raises ChildFailedError with a traceback of its own, whatever the rank printed)."""
    blocks = output.split("Traceback (most recent call last):")[1:]
    return [block for block in blocks if "ChildFailedError" not in block]


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "nproc"), [("two", 1), ("one", 2)])
def test_a_requeue_on_another_process_count_is_refused_in_one_line_on_every_rank(saved_runs, tmp_path, saved, nproc):
    """Two-to-one and one-to-two without the flag: every rank prints the same one line naming both counts and the
    flag (no traceback but the launcher's report of a failed rank), before anything loads (no data log line), and
    the run directory gains nothing but its lock."""
    run = requeued(saved_runs[saved], tmp_path / "run")
    before = sorted(p.name for p in run.rglob("*"))  # run.lock aside: the refusal comes after the lock is taken
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        resume_command(nproc, run, saved_runs), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    saved_count = 2 if saved == "two" else 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(lines) == nproc and len(set(lines)) == 1, result.stderr[-3000:]
    assert f"saved by {saved_count} processes and this launch has {nproc}" in lines[0]
    assert "--allow-world-size-change" in lines[0]
    assert not rank_tracebacks(result.stderr), result.stderr[-3000:]
    assert "data: records=" not in result.stderr + result.stdout
    assert sorted(p.name for p in run.rglob("*") if p.name != "run.lock") == before


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "nproc"), [("two", 1), ("one", 2)])
def test_with_the_flag_the_run_continues_on_the_new_process_count(saved_runs, tmp_path, saved, nproc):
    """With --allow-world-size-change, two-to-one and one-to-two resume at step 2 and finish: steps 3 and 4 logged
    once each after the saved ones, the summary counts the new processes, and the new checkpoint records them."""
    run = requeued(saved_runs[saved], tmp_path / "run")
    run_processes(resume_command(nproc, run, saved_runs, "--allow-world-size-change"), tmp_path / "log", "requeue")
    assert [r["step"] for r in run_files.training_records(run)] == [1, 2, 3, 4]
    assert run_files.read_summary(run)["num_processes"] == nproc
    marker = json.loads((run / "checkpoints" / "step_00000004" / "COMPLETE").read_text())
    assert marker["num_processes"] == nproc


@pytest.mark.slow
def test_with_the_flag_the_model_continues_as_saved(saved_runs, tmp_path):
    """One process resuming the two-process step-2 checkpoint with the flag holds the saved weights: its export
    (train.max_steps=2: nothing more to train), loaded back, equals the checkpoint's model, bit for bit."""
    saved = saved_runs["two"] / "checkpoints" / "step_00000002"
    args = [f"checkpoint.resume={saved}", "train.max_steps=2", "checkpoint.export=true", "--allow-world-size-change"]
    launch(1, tmp_path / "run", saved_runs["data"], saved_runs["cache"], *args)
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "run" / "final").state_dict()
    checkpointed = {k.removeprefix("model."): v for k, v in load_file(saved / "model.safetensors").items()}
    assert exported.keys() == checkpointed.keys()
    assert all(torch.equal(exported[k], checkpointed[k]) for k in exported)
