"""Imported by the forkserver that starts the data loader's workers (`data.pipeline.worker_start_context`), before
it forks any.

- The server and every worker it forks answer SIGUSR1 with their threads' Python stacks, as train.py does, from
  their first instruction: a handler a worker set itself would leave a window in which the signal
  (verification/launch.py sends it to every process of a run) kills it.
- The server dies with the training process, and each worker with the server. A worker's parent is the server, and
  torch's worker watchdog only checks that its parent lives (and misses a parent gone before the worker started),
  while the workers keep the server's liveness pipe open: after a crash or a kill of the training process, both
  would otherwise stay, holding memory.
- The server ignores SIGTERM and SIGINT, and so does every worker (`data.pipeline.ignore_stop_signals`, as torch's
  worker loop installs its own SIGTERM handler). Schedulers signal every process of a job (SLURM), and launchers
  signal each rank's whole process group (torch's elastic agent): the training process then finishes its step and
  saves (lifecycle/preemption.py), which needs its loaders' workers alive; they end with it anyway.
- It imports the pipeline, so each worker starts with torch, transformers and datasets loaded and only unpickles its
  epoch.
"""

import ctypes
import faulthandler
import os
import signal
import sys

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # before the slow import below: a signal then must not end us
signal.signal(signal.SIGINT, signal.SIG_IGN)

import data.pipeline  # noqa: E402, F401  (loaded once in the server, for every worker)

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` (its parent) ends, or now if it already has. Linux only: elsewhere a
    killed run's server and workers stay until killed. The kernel sends it when the parent's thread that forked this
    process ends: `worker_start_context` is first called where the loaders are built, on the main thread, and the
    server forks its workers on its only thread."""
    if not sys.platform.startswith("linux"):
        return
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:  # e.g. a seccomp sandbox
        error = os.strerror(ctypes.get_errno())
        print(f"warning: loader process {os.getpid()} outlives a killed run: prctl failed: {error}", file=sys.stderr)
        return
    if os.getppid() != parent:
        os._exit(0)


SERVER = os.getpid()
_forked_by = 0  # the pid of the process that last forked; a forked child reads its parent's value


def _before_fork() -> None:
    global _forked_by
    _forked_by = os.getpid()


def _after_fork_in_child() -> None:
    if _forked_by == SERVER:  # a loader worker (not a process that a worker itself forks)
        _die_with_parent(SERVER)


faulthandler.register(signal.SIGUSR1, all_threads=True)
_die_with_parent(os.getppid())
os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
