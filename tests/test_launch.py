"""scripts/launch.py, the scripts' one launcher: exit codes, the log and its tail, kill on timeout or teardown hang."""

from __future__ import annotations

import sys

from scripts.launch import free_port, log_tail, run_logged


def test_exit_code_and_log_tail(tmp_path):
    """A launch that ends returns its exit code, and its output (stdout and stderr) is in the log."""
    log = tmp_path / "run.log"
    script = "import sys; print('a'); print('b'); print('c', file=sys.stderr); sys.exit(3)"
    outcome = run_logged([sys.executable, "-c", script], log, timeout=120)
    assert outcome.code == 3 and not outcome.hung_in_teardown
    assert log_tail(log, 2) == "b\nc"


def test_timeout_kills_the_launch(tmp_path):
    """A launch still running at its timeout is killed (code None) and what it printed stays in the log."""
    log = tmp_path / "run.log"
    script = "import time; print('started', flush=True); time.sleep(120)"
    outcome = run_logged([sys.executable, "-c", script], log, timeout=3)
    assert outcome.code is None and not outcome.hung_in_teardown and outcome.wall_s < 60
    assert log_tail(log, 5) == "started"


def test_a_launch_killed_at_its_timeout_leaves_its_stacks_in_the_log(tmp_path):
    """A process that answers SIGUSR1 with its stacks (as train.py does) prints them into the log before the kill."""
    log = tmp_path / "run.log"
    script = (
        "import faulthandler, signal, time\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        "def waiting_for_a_batch():\n"
        "    time.sleep(120)\n"
        "print('started', flush=True)\n"
        "waiting_for_a_batch()\n"
    )
    outcome = run_logged([sys.executable, "-c", script], log, timeout=3)
    assert outcome.code is None
    text = log.read_text()
    assert "waiting_for_a_batch" in text and ("Thread 0x" in text or "Current thread" in text)


def test_a_launch_hanging_after_its_done_file_is_killed_in_teardown(tmp_path):
    """Once the done file exists, a launch still alive `teardown_grace_s` later is killed and reported as hung in
    teardown, long before its timeout."""
    log, done = tmp_path / "run.log", tmp_path / "summary.json"
    script = f"import pathlib, time; pathlib.Path({str(done)!r}).write_text('{{}}'); time.sleep(120)"
    outcome = run_logged([sys.executable, "-c", script], log, timeout=110, done_file=done, teardown_grace_s=1)
    assert outcome.code is None and outcome.hung_in_teardown and outcome.wall_s < 60


def test_free_port_is_a_port():
    """free_port names a TCP port a launcher can pass as --main_process_port."""
    assert 0 < free_port() < 65536
