"""Preemption: SIGTERM or SIGINT (how SLURM, Kubernetes and spot instances stop a job; Ctrl-C) ends the run at the
next optimizer-step boundary with a complete checkpoint, and the exit status EXIT_STATUS.

    signal ─► handler sets this rank's flag ─► trainer/loop.py after each step: the ranks agree (one host-side
    all-reduce) ─► log, evaluate if due, checkpoint ─► Preempted ─► train.py: preempted.json, exit status 75

A watcher thread reads the signals through Python's wakeup fd, so it sees them at once even while the main thread
waits inside C (a collective, a file write), where Python-level handlers cannot run. It bounds the stop: when the
stop has not ended the process within `checkpoint.preempt_timeout_s` of the first signal, or when a second signal
comes (REPEAT_WINDOW_S or more after the first: schedulers signal every process of a job and launchers forward the
signal again, so copies that close together are one request), it ends the process at once with the same status.
The latest complete checkpoint is intact either way: a checkpoint is complete only once its marker is written, last
(lifecycle/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

EXIT_STATUS = 75  # EX_TEMPFAIL (sysexits.h): stopped early on a signal, resumable with --resume: requeue the job
SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 2.0  # a signal this soon after the first is the same request (see the module docstring)


class Preempted(Exception):
    """The run stopped on a signal after optimizer step `step`; `checkpoint`: the checkpoint saved at that step
    (None when the stop came before this launch's first step, with nothing new to save)."""

    def __init__(self, step: int, checkpoint: Path | None, signal_name: str | None = None):
        super().__init__(step, checkpoint)
        self.step, self.checkpoint, self.signal_name = step, checkpoint, signal_name

    def __str__(self) -> str:
        saved = f"saved {self.checkpoint}" if self.checkpoint else "nothing new to save"
        return (
            f"stopped by {self.signal_name or 'a signal'} after step {self.step} ({saved}); relaunch with --resume "
            f"to continue (exit status {EXIT_STATUS})"
        )


class SignalWatch:
    """SIGTERM and SIGINT handled for a `with` block (the previous handlers come back after it); `requested` tells
    whether one came. Enter it on the main thread. `exit` ends the process (os._exit; tests pass a recorder)."""

    def __init__(self, timeout_s: float, exit: Callable[[int], None] = os._exit):
        self.timeout_s = timeout_s
        self.signal_name: str | None = None
        self._exit = exit
        self._requested = threading.Event()
        self._closing = False
        self._forced_exit_hooks: list[Callable[[str], None]] = []
        self._thread: threading.Thread | None = None

    @property
    def requested(self) -> bool:
        """Whether SIGTERM or SIGINT came to this process (no collective: trainer/loop.py agrees across ranks)."""
        return self._requested.is_set()

    def on_forced_exit(self, hook: Callable[[str], None]) -> None:
        """Call `hook(reason)` just before a forced exit (timeout, second signal), e.g. to release the run lock."""
        self._forced_exit_hooks.append(hook)

    def __enter__(self) -> SignalWatch:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # set_wakeup_fd's requirement: a full pipe must never block a handler
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._previous = {signum: signal.signal(signum, self._handle) for signum in SIGNALS}
        self._thread = threading.Thread(target=self._watch, name="preemption-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_fd)
        self._closing = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._write, b"\0")  # not a signal number: wakes the watcher, which sees _closing
        self._thread.join()
        os.close(self._read)
        os.close(self._write)

    def _handle(self, signum: int, frame) -> None:
        """The Python-level handler (main thread): the flag, set before the main thread goes on."""
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
        self._requested.set()

    def _watch(self) -> None:
        first_at = None
        while True:
            wait = None if first_at is None else max(0.0, first_at + self.timeout_s - time.monotonic())
            ready, _, _ = select.select([self._read], [], [], wait)
            if self._closing:
                return
            if not ready:
                self._force_exit(
                    f"the stop after {self.signal_name} did not end within checkpoint.preempt_timeout_s="
                    f"{self.timeout_s:g} s"
                )
                return
            for signum in os.read(self._read, 512):
                if signum not in SIGNALS:
                    continue
                name = signal.Signals(signum).name
                if first_at is None:
                    first_at = time.monotonic()
                    self.signal_name = self.signal_name or name
                    self._requested.set()
                    _stderr(
                        f"{name}: stopping after the current optimizer step with a checkpoint, within "
                        f"checkpoint.preempt_timeout_s={self.timeout_s:g} s (a second signal stops at once)"
                    )
                elif time.monotonic() - first_at >= REPEAT_WINDOW_S:
                    self._force_exit(f"a second {name}")
                    return

    def _force_exit(self, reason: str) -> None:
        _stderr(
            f"{reason}: exiting now without a new checkpoint (exit status {EXIT_STATUS}); the latest complete "
            "checkpoint is intact: relaunch with --resume"
        )
        for hook in self._forced_exit_hooks:
            with contextlib.suppress(Exception):  # the exit must happen whatever a hook meets
                hook(reason)
        self._exit(EXIT_STATUS)


def _stderr(message: str) -> None:
    """One line on stderr, written directly: the logging module's locks may be held by the main thread, which this
    thread must never wait for."""
    with contextlib.suppress(OSError):
        os.write(2, (message + "\n").encode())
