"""`kill -USR1 <pid>` on a training process prints every thread's Python stack to stderr (faulthandler) for the
whole run: where a run that stopped making progress waits. verification/launch.py asks for it before a timeout kill.

Triton's LLVM can take SIGUSR1 over the first time it compiles a kernel in a process (whether it does depends on the
Triton build and the host): LLVM registers it as an "info" signal and answers it with nothing, replacing
faulthandler's handler. A GPU run compiles its first kernels (fla's self-check, the first step) after train.py has
registered the dump. LLVM registers its handlers once per process, so a watcher thread puts the
dump back whenever it finds another handler installed.
"""

from __future__ import annotations

import ctypes
import faulthandler
import signal
import threading
import time

SIGNAL = signal.SIGUSR1
CHECK_EVERY_S = 2.0  # a handler taken over is back within this
_libc = ctypes.CDLL(None, use_errno=True)


def installed_handler() -> int | None:
    """The address of SIGNAL's C-level handler (its `sa_handler`), or None where sigaction cannot be read."""
    action = ctypes.create_string_buffer(512)  # room for any libc's struct sigaction; sa_handler is its first field
    if _libc.sigaction(ctypes.c_int(SIGNAL), None, action) != 0:
        return None
    return ctypes.c_void_p.from_buffer(action).value


def _register() -> None:
    faulthandler.register(SIGNAL, all_threads=True)


def install() -> None:
    """Register the dump and start the watcher that keeps it registered. Call once, from the main thread."""
    # faulthandler restores the handler it replaced while the watcher swaps handlers: SIG_IGN, not the default,
    # which would end the process if the signal came in that moment
    signal.signal(SIGNAL, signal.SIG_IGN)
    _register()
    ours = installed_handler()
    if ours is not None:
        threading.Thread(target=_keep, args=(ours,), name="stack-dump-watch", daemon=True).start()


def _keep(ours: int) -> None:
    while True:  # a daemon thread: it lives as long as the process
        time.sleep(CHECK_EVERY_S)
        if installed_handler() != ours:
            faulthandler.unregister(SIGNAL)  # faulthandler reinstalls only after an unregister
            _register()
