"""Checkpoints verified before a resume trusts them (lifecycle/checkpoint_manifest.py, lifecycle/trusted_resume.py):
the COMPLETE marker records every file's size and checksum; `--resume` passes over a checkpoint that no longer
matches to the newest one that does, with a warning naming it, and refuses in one line when none does.

The runs are tests/test_cluster.py's 4-step runs of the tiny recipe (checkpoints at steps 2 and 4, the export)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lifecycle import checkpoint, checkpoint_manifest
from tests.test_cluster import INLINE, assert_same_run, launch_two, run_cli
from tests.test_train import TINY, run_args

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_cache) -> Path:
    """A finished run: the original of every copy the tests damage, and the run a resume must end equal to."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert run_cli(out, data_cache, INLINE) == 0
    return out


def copy_run(finished: Path, into: Path) -> Path:
    shutil.copytree(finished, into)
    return into


def damage(path: Path, how: str) -> None:
    """Truncate `path`, flip one byte of it (its size unchanged), or delete it."""
    if how == "truncated":
        with path.open("r+b") as handle:
            handle.truncate(path.stat().st_size // 2)
    elif how == "flipped byte":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        path.unlink()


def test_the_marker_records_every_file_with_its_size_and_checksum(finished):
    """Each checkpoint's COMPLETE names its step, the process count and exactly the files beside it, each with the
    size on disk and the xxh3-128 of its bytes."""
    for directory in checkpoint.checkpoint_dirs(finished):
        record = json.loads((directory / checkpoint.COMPLETE).read_text())
        assert record["step"] == int(directory.name.removeprefix("step_")) and record["num_processes"] == 1
        files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
        assert sorted(record["files"]) == [f for f in files if f != checkpoint.COMPLETE]
        assert {"model.safetensors", "optimizer.bin", "trainer_state_rank0.pt"} <= set(record["files"])
        for name, entry in record["files"].items():
            assert entry["bytes"] == (directory / name).stat().st_size
            assert entry["xxh3_128"] == checkpoint_manifest.file_checksum(directory / name)


def test_the_ranks_share_the_files_by_size():
    """Every file goes to exactly one rank, the same deal on every rank, and no rank reads much more than another:
    the largest file first to the least-loaded rank."""
    sizes = {f"f{i}": size for i, size in enumerate([900, 500, 400, 300, 300, 100, 50, 1])}
    shares = [checkpoint_manifest.share(sizes, rank, 3) for rank in range(3)]
    assert sorted(p for share in shares for p in share) == sorted(sizes)
    loads = [sum(sizes[p] for p in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes.values()) // 2
    assert checkpoint_manifest.share(sizes, 0, 1) == sorted(sizes, key=lambda p: -sizes[p])


@pytest.mark.parametrize(
    ("how", "detail"),
    [  # the same-size change (the checksum's case) in the fast tier, the others in the slow one
        pytest.param("truncated", r"optimizer\.bin has \d+ bytes, \d+ recorded", marks=pytest.mark.slow),
        ("flipped byte", r"optimizer\.bin has another xxh3_128 checksum than recorded"),
        pytest.param("missing", r"optimizer\.bin is missing", marks=pytest.mark.slow),
        pytest.param("marker cut short", r"its COMPLETE marker is unreadable", marks=pytest.mark.slow),
    ],
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one(finished, data_cache, tmp_path, caplog, how, detail):
    """The step-4 checkpoint's optimizer state truncated, changed in one byte (same size) or deleted after it was
    complete, or its marker cut short: --resume warns naming it and what is wrong, renames it step_00000004.damaged,
    resumes from step 2 and ends equal to the uninterrupted run, bit for bit."""
    run = copy_run(finished, tmp_path / "run")
    saved = run / "checkpoints" / "step_00000004"
    if how == "marker cut short":
        damage(saved / checkpoint.COMPLETE, "truncated")
    else:
        damage(saved / "optimizer.bin", how)
    with caplog.at_level("WARNING"):
        assert run_cli(run, data_cache, INLINE, resume=True) == 0
    warning = next(r.getMessage() for r in caplog.records if "does not match what its COMPLETE" in r.getMessage())
    assert str(run / "checkpoints" / "step_00000004") in warning and "resuming from the older step_00000002" in warning
    assert re.search(detail, warning), warning
    assert (run / "checkpoints" / "step_00000004.damaged").is_dir()
    assert_same_run(run, finished)


@pytest.mark.parametrize(
    ("text", "readable", "step"),
    [("2\n", True, 2), ('{"step": 2, "num_processes": 1, "files": {"a": {"by', False, -1), ("", False, -1)],
)
def test_a_marker_reads_as_a_record_a_plain_step_or_unreadable(tmp_path, text, readable, step):
    """A plain step is an older marker that vouches for no file; a record cut short or an empty marker is
    unreadable (the checkpoint counts as damaged), never a record of nothing."""
    (tmp_path / "COMPLETE").write_text(text)
    manifest = checkpoint_manifest.read(tmp_path / "COMPLETE")
    assert (manifest.readable, manifest.step, manifest.files) == (readable, step, None)


def test_checksums_off_records_sizes_only_and_still_catches_a_truncation(tmp_path):
    """checkpoint.checksums=false: the marker records sizes but no checksum; a truncated file is still damage, a
    same-size change is not detectable (and not reported)."""
    (tmp_path / "a.bin").write_bytes(b"x" * 100)
    entries = checkpoint_manifest.describe(tmp_path, ["a.bin"], checksums=False)
    assert entries == {"a.bin": {"bytes": 100}}
    manifest = checkpoint_manifest.Manifest(step=1, num_processes=1, files=entries)
    (tmp_path / "a.bin").write_bytes(b"y" * 100)
    assert checkpoint_manifest.damage(tmp_path, manifest, ["a.bin"]) == []
    (tmp_path / "a.bin").write_bytes(b"y" * 99)
    assert checkpoint_manifest.damage(tmp_path, manifest, ["a.bin"]) == ["a.bin has 99 bytes, 100 recorded"]


@pytest.mark.slow
def test_a_plain_marker_is_trusted_as_written(finished, data_cache, tmp_path):
    """A checkpoint whose marker is the step alone (saved before markers recorded files) resumes as before."""
    run = copy_run(finished, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    (run / "checkpoints" / "step_00000002" / checkpoint.COMPLETE).write_text("2\n")
    assert run_cli(run, data_cache, INLINE, resume=True) == 0
    assert_same_run(run, finished)


def resume_in_subprocess(run: Path, data_cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "train.py", "--config", TINY, *run_args(run, data_cache, INLINE, *overrides), "--resume"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_when_no_checkpoint_verifies_resume_refuses_in_one_line(finished, data_cache, tmp_path):
    """Both checkpoints damaged: train.py exits 1 with one line naming each and its damage (no traceback), and
    leaves them where they are (a relaunch refuses again rather than start the run anew)."""
    run = copy_run(finished, tmp_path / "run")
    damage(run / "checkpoints" / "step_00000004" / "model.safetensors", "truncated")
    damage(run / "checkpoints" / "step_00000002" / "scheduler.bin", "flipped byte")
    result = resume_in_subprocess(run, data_cache)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: no checkpoint of {run} matches what its COMPLETE marker recorded (")
    assert "step_00000004: model.safetensors has" in last and "step_00000002: scheduler.bin has another" in last
    assert [p.name for p in checkpoint.checkpoint_dirs(run)] == ["step_00000002", "step_00000004"]


def test_an_explicit_damaged_checkpoint_is_refused_in_one_line(finished, data_cache, tmp_path):
    """checkpoint.resume=<dir> of a damaged checkpoint: one line naming it and the damage, no fallback."""
    run = copy_run(finished, tmp_path / "run")
    target = run / "checkpoints" / "step_00000002"
    damage(target / "model.safetensors", "truncated")
    message = run_cli(tmp_path / "other", data_cache, INLINE, f"checkpoint.resume={target}")
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith(f"error: checkpoint.resume={target} does not match what its COMPLETE marker recorded")
    assert "model.safetensors has" in message


@pytest.mark.slow
def test_two_processes_share_the_check_and_decide_alike(data_cache, tmp_path):
    """Under two processes (each checks its share of the files): a damaged newest checkpoint is passed over once
    (one warning, one rename) and the resumed run ends equal to the uninterrupted two-process run, bit for bit; with
    every checkpoint damaged both ranks stop with the same one line."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    code, output = launch_two(ROOT / "train.py", reference, data_cache)
    assert code == 0, output[-3000:]
    shutil.copytree(reference, run)
    damage(run / "checkpoints" / "step_00000004" / "model.safetensors", "truncated")
    code, output = launch_two(ROOT / "train.py", run, data_cache, "--resume")
    assert code == 0, output[-3000:]
    assert output.count("does not match what its COMPLETE marker recorded") == 1, output[-3000:]
    assert (run / "checkpoints" / "step_00000004.damaged").is_dir()
    assert_same_run(run, reference)
    for saved in checkpoint.checkpoint_dirs(run):
        damage(saved / "optimizer.bin", "flipped byte")
    code, output = launch_two(ROOT / "train.py", run, data_cache, "--resume")
    refusals = [line for line in output.splitlines() if line.startswith("error: no checkpoint of ")]
    assert code != 0 and len(refusals) == 2 and len(set(refusals)) == 1, output[-3000:]
