"""The batch prefetcher: batches in order, the consumed position as its state, a loader error raised in the
training thread, and a warning when the step waits long for a batch."""

from __future__ import annotations

import logging
import threading

import pytest

from data import prefetch


class CountingLoader:
    """Yields {"i": 0..n-1}; its state is the number yielded; `gate` (when set) holds the batch after `hold_after`."""

    def __init__(self, n: int, hold_after: int | None = None, fail_at: int | None = None):
        self.n, self.hold_after, self.fail_at = n, hold_after, fail_at
        self.position = 0
        self.gate = threading.Event()

    def __iter__(self):
        for i in range(self.n):
            if i == self.fail_at:
                raise RuntimeError("bad record")
            if self.hold_after is not None and i > self.hold_after:
                self.gate.wait()
            self.position = i + 1
            yield {"i": i}

    def state_dict(self) -> dict:
        return {"position": self.position}


def test_batches_in_order_with_the_consumed_position():
    prefetcher = prefetch.Prefetcher(CountingLoader(5), depth=2)
    try:
        assert [next(prefetcher)["i"] for _ in range(3)] == [0, 1, 2]
        assert prefetcher.state_dict() == {"position": 3}  # what was consumed, however far the thread read ahead
    finally:
        prefetcher.close()


def test_a_loader_error_is_raised_in_the_training_thread():
    prefetcher = prefetch.Prefetcher(CountingLoader(5, fail_at=1))
    try:
        assert next(prefetcher)["i"] == 0
        with pytest.raises(RuntimeError, match="bad record"):
            next(prefetcher)
    finally:
        prefetcher.close()


class ReleaseAfter(logging.Handler):
    """Counts the stall warnings and opens `gate` at the `count`-th: the loader stays stalled until the log shows
    it, however slowly the machine runs."""

    def __init__(self, gate: threading.Event, count: int):
        super().__init__(logging.WARNING)
        self.gate, self.count, self.warnings = gate, count, []

    def emit(self, record: logging.LogRecord) -> None:
        if "for the next batch" in record.getMessage():
            self.warnings.append(record)
            if len(self.warnings) == self.count:
                self.gate.set()


def test_a_long_wait_for_a_batch_is_logged(monkeypatch, caplog):
    """A stalled loader shows in the log, once per STALL_WARN_S waited (it is released by the second warning), and
    the batch still arrives when it comes."""
    monkeypatch.setattr(prefetch, "STALL_WARN_S", 0.05)
    loader = CountingLoader(3, hold_after=0)
    release = ReleaseAfter(loader.gate, count=2)
    logger = logging.getLogger(prefetch.__name__)
    prefetcher = prefetch.Prefetcher(loader, depth=1)
    try:
        assert next(prefetcher)["i"] == 0
        with caplog.at_level(logging.WARNING, logger=prefetch.__name__):
            logger.addHandler(release)
            assert next(prefetcher)["i"] == 1
        assert len(release.warnings) >= 2
    finally:
        logger.removeHandler(release)
        loader.gate.set()
        prefetcher.close()
