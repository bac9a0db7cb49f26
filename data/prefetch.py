"""Batches collated ahead of the training step, in a background thread, with an exact resume position."""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

log = logging.getLogger(__name__)

STALL_WARN_S = 60.0
"""The training step warns after waiting this long for a batch, and again after every further wait as long: a slow
or stalled data loader shows in the log instead of as a silent pause (the step itself never waits on data)."""


def pinned(value):
    """`value` with every tensor in it, through nested dicts (a batch's vision plans), in pinned host memory."""
    if isinstance(value, torch.Tensor):
        return value.pin_memory()
    if isinstance(value, dict):
        return {key: pinned(item) for key, item in value.items()}
    return value


class Prefetcher:
    """Collates the next batches in a background thread, so the host's image processing overlaps the GPU's work
    (the step itself never syncs, but the launch queue is only so deep).

    Hands out host batches (pinned when `pin` is set) and remembers the loader position after each one it handed
    out: `state_dict()` is what was consumed, not what was prefetched, so a checkpoint resumes exactly.
    """

    def __init__(self, loader, depth: int = 2, pin: bool = False):
        self.loader = loader
        self.pin = pin
        self._state = loader.state_dict()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="batch-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: tuple) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                for batch in self.loader:
                    if self.pin:
                        batch = pinned(batch)
                    if not self._put((batch, self.loader.state_dict(), None)):
                        return
        except Exception as error:  # handed to the training thread, which raises it
            self._put((None, None, error))

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> dict:
        started = time.monotonic()
        while True:
            try:
                batch, state, error = self._queue.get(timeout=STALL_WARN_S)
                break
            except queue.Empty:
                log.warning(
                    "waited %.0f s for the next batch: the data loader's workers are slow (large images, too few "
                    "data.num_workers) or stalled",
                    time.monotonic() - started,
                )
        if error is not None:
            raise error
        self._state = state
        return batch

    def state_dict(self) -> dict:
        return self._state

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
