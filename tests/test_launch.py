"""scripts/launch.py, the scripts' one launcher: exit codes, the log and its tail, kill on timeout or teardown hang."""

from __future__ import annotations

import sys

import pytest

from verification.launch import free_port, log_tail, run_logged

pytestmark = pytest.mark.slow  # the slow tier: `make test-all`


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
    text = log.read_text()
    assert text.startswith("started\n") and "[launch] killing process" in text


def test_a_launch_killed_at_its_timeout_leaves_each_process_s_state_and_stacks_in_the_log(tmp_path):
    """At the timeout, every process of the launch that answers SIGUSR1 with its stacks (as train.py and its loader
    workers do) prints them into the log before the kill, one process after the other under a header with its
    command line, and every thread's kernel state is listed (what shows where a process that cannot print waits)."""
    log = tmp_path / "run.log"
    handler = "import faulthandler, signal, subprocess, sys, time\n"
    handler += "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
    child = handler + "def waiting_in_the_child():\n    time.sleep(120)\nwaiting_in_the_child()\n"
    parent = (
        handler
        + f"subprocess.Popen([sys.executable, '-c', {child!r}, 'the-child'])\n"
        + "def waiting_in_the_parent():\n    time.sleep(120)\n"
        + "print('started', flush=True)\nwaiting_in_the_parent()\n"
    )
    outcome = run_logged([sys.executable, "-c", parent, "the-parent"], log, timeout=5)
    assert outcome.code is None
    text = log.read_text()
    parent_at = text.index("[launch] killing process")
    child_at = text.index("[launch] killing process", parent_at + 1)  # the launched process first, then its child
    assert "waiting_in_the_parent" in text[parent_at:child_at] and "waiting_in_the_child" not in text[:child_at]
    assert "waiting_in_the_child" in text[child_at:]
    if sys.platform.startswith("linux"):
        assert text.count(" state S wchan ") >= 2  # both main threads sleep


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
