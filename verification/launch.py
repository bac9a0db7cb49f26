"""Launching train.py runs: one run in its own process, its output in a log file, killed (with every process under
it) on timeout, and the end of the log for the error message.

Used by verification/throughput_compare.py, verification/parity.py and the multi-process tests; `free_port` gives
a launcher's rendezvous port; `run_logged_together` runs the per-machine launchers of a multi-node job on one host.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from core.distributed import SAFE_COLLECTIVES_ENV

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


STACK_DUMP_WAIT_S = 0.5  # per process: its stack dump is in the log before the next process is asked for its own


def thread_states(pid: int) -> list[str]:
    """One line per thread of `pid` from /proc (Linux; empty elsewhere or once the process is gone): its id, name,
    state and the kernel function it sleeps in. A thread in state D (uninterruptible, inside the kernel: a driver
    call, say) runs no signal handler, so this is what shows where a process that printed no stacks waits."""
    lines = []
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return lines
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            wchan = Path(f"/proc/{pid}/task/{tid}/wchan").read_text().strip() or "-"
        except OSError:
            continue
        name, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()[0]
        lines.append(f"  thread {tid} {name!r} state {state} wchan {wchan}")
        if state == "D":  # its kernel stack, where readable (root)
            try:
                frames = Path(f"/proc/{pid}/task/{tid}/stack").read_text().split("\n")
            except OSError:
                continue
            lines += [f"    {frame}" for frame in frames[:12] if frame]
    return lines


def dump_stacks_then_kill(pid: int, log: TextIO) -> None:
    """Write into `log` (the launch's open log) what each process under the launch (the launcher first) is doing,
    then `kill_process_tree`: its command line, CPU seconds and threads' kernel states (`thread_states`), then its
    Python stacks. train.py answers SIGUSR1 with every thread's stack on stderr, and so do its loader workers and
    their server (data/worker_server.py). The processes are asked one at a time so their dumps do not interleave in
    the shared log; a process without a handler just ends, as it was about to."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            cpu, command = process.cpu_times(), " ".join(process.cmdline()).replace("\n", " ")
            header = (
                f"\n[launch] killing process {process.pid} ({process.status()}, "
                f"{cpu.user:.0f} s user + {cpu.system:.0f} s system CPU): {command[:200]}"
            )
            log.write("\n".join([header, *thread_states(process.pid), "[launch] its Python stacks:\n"]))
            log.flush()
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
    settings (core/distributed.py) in its environment; kill it and every process under it after `timeout` s,
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
                    dump_stacks_then_kill(proc.pid, log)
                    proc.wait()
                    return Outcome(None, time.perf_counter() - start, hung_in_teardown)


def run_logged_together(
    commands: list[list[str]], log_paths: list[Path], timeout: float, env: dict[str, str] | None = None
) -> list[Outcome]:
    """Run `commands` at once (e.g. one launcher per machine of a multi-node job, on this host), each as `run_logged`
    runs one, in a session of its own; after `timeout` s, the ones still running are killed with every process
    under them, each after asking for its stacks. Their outcomes, in order."""
    start = time.perf_counter()
    deadline = time.monotonic() + timeout
    logs = [path.open("w") for path in log_paths]
    try:
        procs = [
            subprocess.Popen(
                command,
                cwd=ROOT,
                env={**(env if env is not None else os.environ), **SAFE_COLLECTIVES_ENV},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for command, log in zip(commands, logs, strict=True)
        ]
        outcomes: list[Outcome | None] = [None] * len(procs)
        while None in outcomes:
            for index, proc in enumerate(procs):
                if outcomes[index] is None and proc.poll() is not None:
                    outcomes[index] = Outcome(proc.returncode, time.perf_counter() - start)
            if None in outcomes and time.monotonic() > deadline:
                for index, proc in enumerate(procs):
                    if outcomes[index] is None:
                        dump_stacks_then_kill(proc.pid, logs[index])
                        proc.wait()
                        outcomes[index] = Outcome(None, time.perf_counter() - start)
            time.sleep(0.2)
        return outcomes
    finally:
        for log in logs:
            log.close()


def log_tail(log_path: Path, lines: int) -> str:
    """The last `lines` lines of a launch's log."""
    return "\n".join(log_path.read_text().splitlines()[-lines:])
