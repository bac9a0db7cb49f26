"""Launching train.py from the scripts: one run in its own process, its output in a log file, killed (with every
process under it) on timeout, and the end of the log for the error message.

Used by compare_throughput.py and distributed_parity.py; `free_port` gives a launcher's rendezvous port.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from training.distributed import SAFE_COLLECTIVES_ENV

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on this host now, for a launcher's rendezvous (`--main_process_port`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kill_process_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it. Killing the launcher's process group is not enough:
    torch's elastic agent starts each rank in a session of its own, so ranks would outlive it."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for process in [*root.children(recursive=True), root]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs([root], timeout=10)


STACK_DUMP_WAIT_S = 2.0  # for the processes' stack dumps to reach the log before the kill


def dump_stacks_then_kill(pid: int) -> None:
    """SIGUSR1 to a launcher and every process under it, then `kill_process_tree`. train.py answers SIGUSR1 with every
    thread's Python stack on stderr (so do its loader workers: data/worker_server.py), so the log says where a run
    that is killed at its timeout was waiting; a process without a handler just ends, as it was about to."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            process.send_signal(signal.SIGUSR1)
        except psutil.NoSuchProcess:
            continue
    time.sleep(STACK_DUMP_WAIT_S)
    kill_process_tree(pid)


@dataclass(frozen=True)
class Outcome:
    """How a launch ended: `code` (None when it was killed), its wall time, whether it was killed in teardown."""

    code: int | None
    wall_s: float
    hung_in_teardown: bool = False


def run_logged(
    command: list[str],
    log_path: Path,
    timeout: float,
    env: dict[str, str] | None = None,
    done_file: Path | None = None,
    teardown_grace_s: float = 0.0,
    new_session: bool = False,
) -> Outcome:
    """Run `command` from the repository root with stdout and stderr in `log_path` and the collectives' safe
    settings (training/distributed.py) in its environment; kill it and every process under it after `timeout` s,
    or `teardown_grace_s` after `done_file` appeared (its work is done then) if it never exits, each after asking
    for its stacks (`dump_stacks_then_kill`)."""
    start = time.perf_counter()
    deadline = time.monotonic() + timeout
    done_at = None
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**(env if env is not None else os.environ), **SAFE_COLLECTIVES_ENV},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )
        while True:
            try:
                code = proc.wait(timeout=2 if done_file is not None else max(deadline - time.monotonic(), 0))
                return Outcome(code, time.perf_counter() - start)
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if done_at is None and done_file is not None and done_file.is_file():
                    done_at = now
                hung_in_teardown = done_at is not None and now - done_at > teardown_grace_s
                if hung_in_teardown or now > deadline:
                    dump_stacks_then_kill(proc.pid)
                    proc.wait()
                    return Outcome(None, time.perf_counter() - start, hung_in_teardown)


def log_tail(log_path: Path, lines: int) -> str:
    """The last `lines` lines of a launch's log."""
    return "\n".join(log_path.read_text().splitlines()[-lines:])
