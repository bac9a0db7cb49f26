"""Running on shared clusters (docs/cluster.md): one trainer per run directory (lifecycle/run_lock.py), preemption by
SIGTERM / SIGINT (lifecycle/preemption.py), and checkpoint or export writes that fail (lifecycle/checkpoint.py).

The runs are tests/test_train.py's 4-step runs of the tiny recipe (checkpoints at steps 2 and 4, the export); every
interrupted run, once resumed, is compared with one uninterrupted run bit for bit: each step's loss, gradient norm
and learning rate in metrics.jsonl, and the exported weights."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

import train
from lifecycle import checkpoint, preemption, run_files, run_lock
from tests.test_train import TINY, run_args
from trainer import loop
from verification.launch import free_port, run_logged

ROOT = Path(__file__).resolve().parents[1]
INLINE = "data.num_workers=0"  # in-process runs collate inline: no loader processes to start
HOST = socket.gethostname()


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data-cache")


def run_cli(out: Path, data_cache: Path, *overrides: str, resume: bool = False) -> int | str:
    """train.cli in this process on the tiny 4-step run: 0, the one-line error, or preemption.EXIT_STATUS."""
    try:
        return train.cli(["--config", TINY, *run_args(out, data_cache, *overrides), *(["--resume"] * resume)])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_cache) -> Path:
    """The run every interrupted one must end equal to."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert run_cli(out, data_cache, INLINE) == 0
    return out


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """Each step logged once with the reference's loss, gradient norm and learning rate, and the same exported
    weights, bit for bit; the run is complete (summary.json)."""
    expected = {r["step"]: r for r in run_files.training_records(reference)}
    records = run_files.training_records(run_dir)
    assert [r["step"] for r in records] == sorted(expected)
    for record in records:
        for key in ("loss", "grad_norm", "lr"):
            assert record[key] == expected[record["step"]][key], (record["step"], key)
    weights = load_file(run_dir / "final" / "model.safetensors")
    reference_weights = load_file(reference / "final" / "model.safetensors")
    assert weights.keys() == reference_weights.keys()
    assert all(torch.equal(weights[k], reference_weights[k]) for k in weights)
    assert run_files.has_summary(run_dir)


HANG_GUARD_S = 120.0  # only a test that hangs waits this long: no outcome depends on how fast the machine is


def wait_until(condition, timeout_s: float = HANG_GUARD_S) -> bool:
    """Whether `condition()` came true (polled) before `timeout_s`, a guard against hanging, not a measurement."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def during_step(n: int, action: str) -> str:
    """Code for a child process: run `action` (Python) as optimizer step `n` of this launch starts."""
    return (
        "from trainer import loop as _loop\n"
        "_step, _calls = _loop.optimizer_step, []\n"
        "def _patched(*args):\n"
        "    _calls.append(1)\n"
        f"    if len(_calls) == {n}:\n"
        f"        {action}\n"
        "    return _step(*args)\n"
        "_loop.optimizer_step = _patched\n"
    )


def child_command(out: Path, data_cache: Path, patch: str, *overrides: str) -> list[str]:
    """`python -c`: train.py's cli after `patch`, with the stack dump installed as train.py's __main__ does."""
    args = ["--config", TINY, *run_args(out, data_cache, *overrides)]
    code = "import os, signal, sys, time\n" + patch
    code += f"import train\nfrom lifecycle import stack_dump\nstack_dump.install()\nsys.exit(train.cli({args!r}))\n"
    return [sys.executable, "-c", code]


# ----- one trainer per run directory -----


def test_a_held_run_directory_is_refused_naming_the_holder(tmp_path):
    """A second lock on a held directory is refused with the holder's host and pid; a clean release empties
    run.lock, so the next run takes it without a takeover."""
    first = run_lock.RunLock(tmp_path)
    first.acquire()
    with pytest.raises(run_lock.RunLockError, match=rf"in use by another run: host {HOST} pid {os.getpid()} \("):
        run_lock.RunLock(tmp_path).acquire()
    first.release()
    assert (tmp_path / "run.lock").read_text() == ""
    again = run_lock.RunLock(tmp_path)
    again.acquire()
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    again.release()


def test_train_refuses_a_held_run_directory_with_one_line_before_writing(data_cache, tmp_path):
    """train.py on a directory another run holds ends at once with one line naming that run's host and pid, and
    writes nothing there (no config.yaml, metrics.jsonl, checkpoints)."""
    holder = run_lock.RunLock(tmp_path / "run")
    (tmp_path / "run").mkdir()
    holder.acquire()
    try:
        message = run_cli(tmp_path / "run", data_cache, INLINE)
    finally:
        holder.release()
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith(f"error: train.output_dir={tmp_path / 'run'} is in use by another run: host {HOST} ")
    assert f"pid {os.getpid()} " in message
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run.lock"]


HOLD_THEN_DIE = """
import os, sys
from pathlib import Path
from lifecycle.run_lock import RunLock
RunLock(Path(sys.argv[1])).acquire()
os.kill(os.getpid(), 9)
"""


def test_the_lock_of_a_killed_run_is_taken_over_with_a_log_line(tmp_path, caplog):
    """A holder killed with SIGKILL releases the lock with its life (flock); the next run takes it over and logs
    whose lock it took."""
    process = subprocess.run([sys.executable, "-c", HOLD_THEN_DIE, str(tmp_path)], cwd=ROOT, capture_output=True)
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-2000:]
    dead_pid = json.loads((tmp_path / "run.lock").read_text())["pid"]
    lock = run_lock.RunLock(tmp_path)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    lock.release()
    assert f"took over the run-directory lock of host {HOST} pid {dead_pid} (started " in caplog.text


def test_host_local_flock_still_refuses_a_live_run_of_another_host(tmp_path, caplog, monkeypatch):
    """Where flock does not reach across hosts, a free flock over another host's record refreshed within STALE_S is
    that host's live run: refused. Once the record is older than STALE_S (a lost node), it is taken over."""
    other = {"host": "node-b", "pid": 4242, "pid_started": 0.0, "started": "2026-01-01T00:00:00+0000"}
    (tmp_path / "run.lock").write_text(json.dumps(other))
    with pytest.raises(run_lock.RunLockError, match=r"host node-b pid 4242 .*does not reach across hosts"):
        run_lock.RunLock(tmp_path).acquire()
    stale = time.time() - run_lock.STALE_S - 1
    os.utime(tmp_path / "run.lock", (stale, stale))
    lock = run_lock.RunLock(tmp_path)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    lock.release()
    assert "took over the run-directory lock of host node-b pid 4242" in caplog.text


def test_without_flock_the_lock_file_itself_is_the_lock(tmp_path, caplog, monkeypatch):
    """On a filesystem without flock (ENOLCK) the lock is the file, created exclusively: a second run is refused
    naming the holder; a clean release deletes it; a file left by a dead process of this host, or by another host
    with a heartbeat older than STALE_S, is taken over; another host's fresh file is refused."""

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    path = tmp_path / "run.lock"
    first = run_lock.RunLock(tmp_path)
    first.acquire()
    with pytest.raises(run_lock.RunLockError, match=rf"host {HOST} pid {os.getpid()} "):
        run_lock.RunLock(tmp_path).acquire()
    first.release()
    assert not path.exists()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path.write_text(json.dumps({"host": HOST, "pid": int(dead.stdout), "pid_started": 0.0, "started": "?"}))
    lock = run_lock.RunLock(tmp_path)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert f"took over the run-directory lock of host {HOST} pid {int(dead.stdout)}" in caplog.text
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()

    path.write_text(json.dumps({"host": "node-b", "pid": 1, "pid_started": 0.0, "started": "?"}))
    with pytest.raises(run_lock.RunLockError, match="host node-b pid 1 "):
        run_lock.RunLock(tmp_path).acquire()
    stale = time.time() - run_lock.STALE_S - 1
    os.utime(path, (stale, stale))
    lock = run_lock.RunLock(tmp_path)
    lock.acquire()
    lock.release()
    assert not path.exists()


def test_the_holder_refreshes_its_heartbeat(tmp_path, monkeypatch):
    """The holder's heartbeat keeps run.lock's modification time fresh (what another host reads as alive)."""
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = run_lock.RunLock(tmp_path)
    lock.acquire()
    old = time.time() - 1000
    os.utime(tmp_path / "run.lock", (old, old))
    try:
        assert wait_until(lambda: run_lock.lock_age_s(tmp_path / "run.lock") < 100)
    finally:
        lock.release()


@pytest.mark.slow
def test_two_concurrent_runs_the_second_refuses_and_the_first_finishes_unchanged(uninterrupted, data_cache, tmp_path):
    """While a run trains (held at step 2 here), a second train.py on its directory exits at once with status 1
    and one line naming the first run's host and pid; the first then finishes equal to the uninterrupted run, each
    step logged once."""
    run, go, log = tmp_path / "run", tmp_path / "go", tmp_path / "first.log"
    holding = str(tmp_path / "holding")
    hold = f"open({holding!r}, 'w').close()\n        while not os.path.exists({str(go)!r}): time.sleep(0.05)"
    with log.open("w") as output:
        first = subprocess.Popen(child_command(run, data_cache, during_step(2, hold)), cwd=ROOT, stderr=output)
    try:
        assert wait_until(lambda: Path(holding).exists() or first.poll() is not None, 300)
        started = time.monotonic()
        second = subprocess.run(
            [sys.executable, "train.py", "--config", TINY, *run_args(run, data_cache)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert second.returncode == 1 and time.monotonic() - started < 120
        refusal = second.stderr.strip().splitlines()[-1]
        assert refusal.startswith(f"error: train.output_dir={run} is in use by another run: host {HOST} pid ")
        assert f"pid {first.pid} (started " in refusal
    finally:
        go.touch()
        first.wait(timeout=600)
    assert first.returncode == 0, log.read_text()[-3000:]
    assert_same_run(run, uninterrupted)


@pytest.mark.slow
def test_a_run_killed_with_sigkill_leaves_a_lock_the_next_run_takes_over(uninterrupted, data_cache, tmp_path, caplog):
    """kill -9 during step 3: the relaunch with --resume takes over the dead run's lock, logging its host and pid,
    and ends equal to the uninterrupted run."""
    run = tmp_path / "run"
    killed = subprocess.run(
        child_command(run, data_cache, during_step(3, "os.kill(os.getpid(), signal.SIGKILL)")),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    with caplog.at_level(logging.WARNING):
        assert run_cli(run, data_cache, INLINE, resume=True) == 0
    assert f"took over the run-directory lock of host {HOST} pid " in caplog.text
    assert_same_run(run, uninterrupted)


@pytest.mark.slow
def test_every_rank_of_a_refused_launch_exits_with_the_holders_name(data_cache, tmp_path):
    """Under `accelerate launch` with two processes, only the main process tries the lock; both ranks learn the
    refusal and end with the same one line, before any model is built."""
    (tmp_path / "run").mkdir()
    holder = run_lock.RunLock(tmp_path / "run")
    holder.acquire()
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/ddp.yaml"]
    command += ["--num_processes=2", f"--main_process_port={free_port()}", "train.py", "--config", TINY]
    command += run_args(tmp_path / "run", data_cache)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        outcome = run_logged(command, tmp_path / "run.log", 300, env=env, new_session=True)
    finally:
        holder.release()
    output = (tmp_path / "run.log").read_text()
    assert outcome.code not in (0, None), output[-3000:]
    refusal = f"error: train.output_dir={tmp_path / 'run'} is in use by another run: host {HOST} pid {os.getpid()} "
    assert output.count(refusal) == 2, output[-3000:]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run.lock"]


# ----- preemption -----


@pytest.fixture
def watch_exits():
    """(exit statuses a SignalWatch's forced exits asked for, reasons its hooks got)."""
    return [], []


def watch(timeout_s: float, watch_exits) -> preemption.SignalWatch:
    exits, reasons = watch_exits
    signals = preemption.SignalWatch(timeout_s, exit=exits.append)
    signals.on_forced_exit(reasons.append)
    return signals


def test_a_stop_signal_sets_the_flag_and_the_previous_handlers_come_back(monkeypatch, watch_exits):
    """SIGTERM and SIGINT inside the watch set the stop flag (and name the first signal) without ending the process;
    after the watch, the handlers and the wakeup fd are what they were."""
    monkeypatch.setattr(preemption, "REPEAT_WINDOW_S", 3600.0)  # the SIGINT is a copy however late it comes
    before = {s: signal.getsignal(s) for s in preemption.SIGNALS}
    with watch(30, watch_exits) as signals:
        assert not signals.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.requested and signals.signal_name == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)  # at once: the same request
        time.sleep(0.2)
    assert watch_exits == ([], [])
    assert {s: signal.getsignal(s) for s in preemption.SIGNALS} == before
    assert signal.set_wakeup_fd(-1) == -1


def test_a_stop_that_overruns_its_timeout_exits_with_the_preemption_status(watch_exits):
    """When the process has not ended `checkpoint.preempt_timeout_s` after the signal, the watcher exits with
    status 75 on its own, after running the forced-exit hooks (the run lock's release)."""
    with watch(0.3, watch_exits):
        os.kill(os.getpid(), signal.SIGTERM)
        assert wait_until(lambda: watch_exits[0])
    exits, reasons = watch_exits
    assert exits == [preemption.EXIT_STATUS]
    assert reasons == ["the stop after SIGTERM did not end within checkpoint.preempt_timeout_s=0.3 s"]


def test_a_copy_of_the_first_signal_within_the_window_is_the_same_request(monkeypatch, watch_exits):
    """A copy of the first signal within REPEAT_WINDOW_S (the launcher's copy of the scheduler's signal) does not end
    the process: what ends it is the stop's own timeout."""
    monkeypatch.setattr(preemption, "REPEAT_WINDOW_S", 3600.0)
    with watch(0.3, watch_exits):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert wait_until(lambda: watch_exits[0])
    assert watch_exits == (
        [preemption.EXIT_STATUS],
        ["the stop after SIGTERM did not end within checkpoint.preempt_timeout_s=0.3 s"],
    )


def test_a_second_signal_exits_at_once_while_the_main_thread_waits(monkeypatch):
    """A second signal REPEAT_WINDOW_S or more after the first (here any later one: the window is 0) ends the
    process at once (status 75) from the watcher thread, while the main thread waits (on a lock that only the exit
    releases) and long before the stop's timeout."""
    monkeypatch.setattr(preemption, "REPEAT_WINDOW_S", 0.0)
    waiting, exits, reasons = threading.Lock(), [], []
    waiting.acquire()

    def exit_now(status):
        exits.append(status)
        waiting.release()

    with preemption.SignalWatch(3600, exit=exit_now) as signals:
        signals.on_forced_exit(reasons.append)
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT)).start()
        assert waiting.acquire(timeout=HANG_GUARD_S)  # the stop's own timeout is an hour away
    assert exits == [preemption.EXIT_STATUS] and reasons == ["a second SIGINT"]


AGREE = """
import sys
from types import SimpleNamespace
import torch.distributed as dist
from core.distributed import HostCollectives
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
host = HostCollectives(SimpleNamespace(num_processes=2))
print(host.any(rank == 1), host.any(False), host.gather(f"rank{rank}"), flush=True)
dist.destroy_process_group()
"""


def test_ranks_agree_on_a_stop_only_one_of_them_saw():
    """The host-side agreement: a flag set on rank 1 only is true on both ranks, one set nowhere is false, and every
    rank gets every rank's value (two gloo processes)."""
    port = str(free_port())
    processes = [
        subprocess.Popen([sys.executable, "-c", AGREE, str(rank), port], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in processes]
    assert [p.returncode for p in processes] == [0, 0]
    assert outputs == ["True False ['rank0', 'rank1']"] * 2


def signal_during_step(monkeypatch, n: int, signum: int = signal.SIGTERM) -> None:
    """This process gets `signum` as optimizer step `n` starts (as a scheduler's signal would come mid-step)."""
    original, calls = loop.optimizer_step, []

    def signalled(*args):
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signum)
        return original(*args)

    monkeypatch.setattr(loop, "optimizer_step", signalled)


def test_sigterm_mid_run_saves_the_step_and_resume_equals_the_uninterrupted_run(
    uninterrupted, data_cache, tmp_path, monkeypatch, capsys
):
    """SIGTERM during step 3 of 4: the run finishes step 3, saves a complete checkpoint of it, records
    preempted.json, releases the lock and returns exit status 75 with one line saying how to go on; metrics.jsonl
    holds steps 1-3. --resume then ends equal to the uninterrupted run, bit for bit, and preempted.json is gone."""
    run = tmp_path / "run"
    signal_during_step(monkeypatch, 3)
    assert run_cli(run, data_cache, INLINE) == preemption.EXIT_STATUS
    saved = run / "checkpoints" / "step_00000003"
    assert (
        f"preempted: stopped by SIGTERM after step 3 (saved {saved}); relaunch with --resume to continue "
        "(exit status 75)\n"
    ) in capsys.readouterr().err
    assert checkpoint.checkpoint_dirs(run) == [run / "checkpoints" / "step_00000002", saved]
    record = json.loads((run / "preempted.json").read_text())
    assert (record["signal"], record["step"], record["checkpoint"], record["exit_status"]) == (
        "SIGTERM",
        3,
        str(saved),
        75,
    )
    assert [r["step"] for r in run_files.training_records(run)] == [1, 2, 3]
    assert not (run / "final").exists() and not run_files.has_summary(run)
    assert (run / "run.lock").read_text() == ""
    monkeypatch.undo()
    assert run_cli(run, data_cache, INLINE, resume=True) == 0
    assert_same_run(run, uninterrupted)
    assert not (run / "preempted.json").exists()


def test_a_signal_before_the_first_step_stops_without_a_new_checkpoint(data_cache, tmp_path, monkeypatch):
    """SIGINT while the run is being set up (here: as the optimizer is built) stops it before its first step, with
    status 75 and nothing new to save."""
    from trainer import setup

    original = setup.optim.build_optimizer

    def interrupted(*args):
        os.kill(os.getpid(), signal.SIGINT)
        return original(*args)

    monkeypatch.setattr(setup.optim, "build_optimizer", interrupted)
    run = tmp_path / "run"
    assert run_cli(run, data_cache, INLINE) == preemption.EXIT_STATUS
    record = json.loads((run / "preempted.json").read_text())
    assert (record["signal"], record["step"], record["checkpoint"]) == ("SIGINT", 0, None)
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


@pytest.mark.slow
def test_sigterm_to_every_process_of_a_run_saves_and_resumes_exactly(uninterrupted, data_cache, tmp_path):
    """SIGTERM to the run's whole process group during step 2 (as SLURM signals every process of a job), its loader
    workers and their server included: they ignore it, so the step's evaluation still gets its batches, and
    train.py exits 75 with a checkpoint of step 2; --resume ends equal to the uninterrupted run."""
    run = tmp_path / "run"
    stop = during_step(2, "os.killpg(0, signal.SIGTERM)")
    process = subprocess.run(
        child_command(run, data_cache, stop, "data.num_workers=2"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        start_new_session=True,
    )
    assert process.returncode == preemption.EXIT_STATUS, process.stderr[-3000:]
    assert process.stderr.strip().splitlines()[-1].startswith("preempted: stopped by SIGTERM after step 2 (saved ")
    assert [r["step"] for r in run_files.read_metrics(run) if "eval_loss" in r] == [2]
    assert checkpoint.latest_checkpoint(run).name == "step_00000002"
    assert run_cli(run, data_cache, INLINE, resume=True) == 0
    assert_same_run(run, uninterrupted)


@pytest.mark.slow
def test_loader_workers_and_their_server_outlive_a_stop_signal():
    """SIGTERM and SIGINT to the loader's workers and their forkserver (a scheduler signals every process of a job)
    end none of them: the batches after the signal, past what the workers had collated ahead, still arrive, so the
    step in progress finishes and saves (torch's worker loop would end a worker on SIGTERM)."""
    from tests.test_data_pipeline import forkserver_processes, synthetic_loader

    batches = iter(synthetic_loader(200, num_workers=2))  # 100 packs: the workers collate 8 ahead
    next(batches)
    processes = forkserver_processes(os.getpid())
    assert len(processes) >= 3  # the server and two workers
    for process in processes:
        process.send_signal(signal.SIGTERM)
        process.send_signal(signal.SIGINT)
    assert len([next(batches) for _ in range(40)]) == 40
    assert all(process.is_running() for process in processes)


FAILING_EVAL = (
    "from trainer import loop as _loop\n"
    "def _evaluate(accelerator, module, loader, batches, start):\n"
    "    for batch in loader:  # as trainer.step.evaluate: the error comes with the loader's iterator started\n"
    "        raise RuntimeError('CUDA out of memory (injected)')\n"
    "_loop.evaluate = _evaluate\n"
)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["step", "eval"])
def test_an_error_ends_the_process_and_its_loader_workers(data_cache, tmp_path, where):
    """An error in a step or an evaluation (a CUDA out-of-memory, say) while loader workers run: the process prints
    the error and exits with a non-zero status. The workers ignore SIGTERM, so the interpreter's exit, which
    terminates and then joins its child processes, would wait forever on workers whose iterator is still alive: the
    prefetcher's thread iterates the training loader until the loop shuts it down."""
    patch = during_step(2, "raise RuntimeError('CUDA out of memory (injected)')") if where == "step" else FAILING_EVAL
    log = tmp_path / "child.log"
    outcome = run_logged(child_command(tmp_path / "run", data_cache, patch, "data.num_workers=2"), log, 240)
    assert outcome.code == 1, log.read_text()  # None: killed at the timeout, still running
    assert "RuntimeError: CUDA out of memory (injected)" in log.read_text()


LAUNCHED = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
{patch}
import train
if __name__ == "__main__":
    sys.exit(train.cli())
"""


def launch_two(script: Path, run: Path, data_cache: Path, *flags: str) -> tuple[int | None, str]:
    """`script` (train.py or a patched copy) under `accelerate launch` with two CPU processes (gloo), on the tiny
    4-step run; (the launcher's exit status, its log)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/ddp.yaml"]
    command += ["--num_processes=2", f"--main_process_port={free_port()}", str(script), "--config", TINY]
    command += [*run_args(run, data_cache, INLINE), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = run.parent / f"{run.name}-{len(list(run.parent.glob(run.name + '-*.log')))}.log"
    outcome = run_logged(command, log, 600, env=env, new_session=True)
    return outcome.code, log.read_text()


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_both_ranks_at_one_step_and_resume_is_exact(data_cache, tmp_path):
    """SIGTERM to `accelerate launch` during step 2 (as Kubernetes or a user stops a job): the launcher forwards
    it to both ranks, which agree on the step to stop after, save one complete checkpoint of it and exit 75;
    preempted.json names it; the launcher itself exits 1 (it reports any rank's non-zero status as 1). Two
    processes relaunched with --resume end equal, bit for bit, to an uninterrupted two-process run."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    code, output = launch_two(ROOT / "train.py", reference, data_cache)
    assert code == 0, output[-3000:]
    signal_launcher = "os.kill(os.getppid(), signal.SIGTERM) if os.environ['RANK'] == '0' else None"
    script = tmp_path / "signalled_train.py"
    script.write_text(LAUNCHED.format(root=str(ROOT), patch=during_step(2, signal_launcher)))
    code, output = launch_two(script, run, data_cache)
    assert code == 1, output[-3000:]
    stops = [line for line in output.splitlines() if "preempted: stopped by SIGTERM after step" in line]
    assert len(stops) == 2 and len(set(stops)) == 1, output[-3000:]
    record = json.loads((run / "preempted.json").read_text())
    assert record["step"] in (2, 3) and record["checkpoint"] == str(checkpoint.latest_checkpoint(run))
    assert checkpoint.latest_checkpoint(run).name == f"step_{record['step']:08d}"
    assert [r["step"] for r in run_files.training_records(run)] == list(range(1, record["step"] + 1))
    code, output = launch_two(ROOT / "train.py", run, data_cache, "--resume")
    assert code == 0, output[-3000:]
    assert_same_run(run, reference)


SLOW_SAVE = """
import accelerate
from lifecycle import preemption
preemption.REPEAT_WINDOW_S = 0.5
_save_state = accelerate.Accelerator.save_state
def _slow_save_state(self, output_dir=None, **kwargs):
    location = _save_state(self, output_dir, **kwargs)  # the model and optimizer are written...
    if output_dir.endswith("step_00000003"):
        print("SAVING", file=sys.stderr, flush=True)
        time.sleep(120)  # ...and the rest takes long
    return location
accelerate.Accelerator.save_state = _slow_save_state
"""


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["second signal", "timeout"])
def test_a_stop_cut_short_leaves_the_previous_checkpoint_intact(uninterrupted, data_cache, tmp_path, ending):
    """SIGTERM during step 3 and a save of step 3 that takes long: a second SIGTERM during the save, or the end of
    checkpoint.preempt_timeout_s, ends the process at once with status 75; the torn step-3 save is not a checkpoint,
    step 2's is intact, preempted.json says why, the lock is released, and --resume ends equal to the uninterrupted
    run. Before the second SIGTERM, a `kill -USR1` prints the stacks and leaves the save going."""
    run = tmp_path / "run"
    timeout = "15" if ending == "timeout" else "300"
    command = child_command(
        run,
        data_cache,
        SLOW_SAVE + during_step(3, "os.kill(os.getpid(), signal.SIGTERM)"),
        f"checkpoint.preempt_timeout_s={timeout}",
    )
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in process.stderr:
        lines.append(line)
        if line.startswith("SAVING"):
            break
    started = time.monotonic()
    if ending == "second signal":
        process.send_signal(signal.SIGUSR1)
        time.sleep(0.6)  # past REPEAT_WINDOW_S
        process.send_signal(signal.SIGTERM)
    stderr = "".join(lines) + process.communicate(timeout=120)[1]
    assert process.returncode == preemption.EXIT_STATUS, stderr[-3000:]
    assert time.monotonic() - started < (20 if ending == "second signal" else 40)
    if ending == "second signal":
        assert "Thread 0x" in stderr and "_slow_save_state" in stderr
    reason = "a second SIGTERM" if ending == "second signal" else "did not end within checkpoint.preempt_timeout_s=15 s"
    assert reason in stderr and "exiting now without a new checkpoint" in stderr
    assert [p.name for p in checkpoint.checkpoint_dirs(run)] == ["step_00000002"]
    assert json.loads((run / "preempted.json").read_text())["checkpoint"] == str(run / "checkpoints/step_00000002")
    assert (run / "run.lock").read_text() == ""
    assert run_cli(run, data_cache, INLINE, resume=True) == 0
    assert_same_run(run, uninterrupted)
    assert not checkpoint.incomplete_dirs(run)


# ----- checkpoint and export writes that fail -----


def test_a_checkpoint_that_cannot_be_written_keeps_the_previous_one_and_resume_finishes(
    uninterrupted, data_cache, tmp_path, monkeypatch
):
    """A full disk during the step-4 checkpoint (torch.save writes part of optimizer.bin, then ENOSPC) stops the
    run with one line naming the checkpoint's path, the bytes it needs (the previous checkpoint's size) and the bytes
    free; the partial checkpoint is gone and step 2's is intact (its files equal the uninterrupted run's). With space
    freed, --resume ends equal to the uninterrupted run."""
    original = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if "step_00000004" in str(f):
            Path(f).write_bytes(b"\0" * 100)  # part of the file, as a full disk leaves it
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return original(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 4096)
    run = tmp_path / "run"
    message = run_cli(run, data_cache, INLINE)
    step2, step4 = run / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000004"
    needed = checkpoint.tree_nbytes(step2)
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith(
        f"error: writing the checkpoint {step4} failed (OSError: [Errno 28] No space left on device: "
        f"'{step4 / 'optimizer.bin'}'); it needs about {needed} bytes ("
    )
    assert "and 4096 bytes (4.0 KiB) are free there. The partial checkpoint is removed" in message
    assert f"the latest complete checkpoint, {step2}, is intact" in message and message.endswith("--resume.")
    assert not step4.exists() and checkpoint.checkpoint_dirs(run) == [step2]
    for name in ("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        assert (step2 / name).read_bytes() == (uninterrupted / "checkpoints" / "step_00000002" / name).read_bytes()
    assert not (run / "final").exists() and not run_files.has_summary(run)
    monkeypatch.undo()
    assert run_cli(run, data_cache, INLINE, resume=True) == 0
    assert_same_run(run, uninterrupted)


def test_an_export_that_cannot_be_written_is_redone_by_resume(uninterrupted, data_cache, tmp_path, monkeypatch):
    """A write error during the export (the processor's files, after the weights: safetensors and torch report
    a full disk as non-OSError exceptions) stops the run with one line naming the partial export and the bytes its
    weights need; no final/ or final.partial/ is left, the checkpoints are complete, and --resume writes only the
    export, equal to the uninterrupted run's."""

    def failing_save(self, directory, *args, **kwargs):
        (Path(directory) / "tokenizer.json").write_text("{")
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.ProcessorMixin, "save_pretrained", failing_save)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 0)
    run = tmp_path / "run"
    message = run_cli(run, data_cache, INLINE)
    weights_nbytes = (uninterrupted / "final" / "model.safetensors").stat().st_size
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith(
        f"error: writing the export {run / 'final.partial'} failed (RuntimeError: Error while serializing: I/O "
        "error: No space left on device (os error 28)); it needs about "
    )
    needed = int(message.split("it needs about ")[1].split(" bytes")[0])
    assert 0.9 * weights_nbytes < needed <= weights_nbytes
    assert not (run / "final").exists() and not (run / "final.partial").exists()
    assert [p.name for p in checkpoint.checkpoint_dirs(run)] == ["step_00000002", "step_00000004"]
    monkeypatch.undo()
    assert run_cli(run, data_cache, INLINE, resume=True) == 0
    assert_same_run(run, uninterrupted)
