"""The predictions file: one JSON line per record, in record order, appended as answers come, resumable.

    {"index": 7, "id": "...", "category": "...", "prompt": "user: <image> What colour ...", "references": ["..."],
     "prediction": "...", "scores": {"exact_match": 1.0, ...}}
    {"index": 8, "id": "...", "category": "...", "skipped": "missing_image", "detail": "img/8.png: No such file ..."}

Each line is written whole and flushed, so a stop (Ctrl-C, SIGTERM, a kill) keeps every line before it; a line a
kill cut short is dropped when the file is resumed. `--resume` continues a partial file: the records whose index is
already there are not generated again, so the finished file has each record once, in order.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterable
from pathlib import Path


class PredictionsFileError(ValueError):
    """The predictions file cannot be written or resumed as asked; the message says what to do."""


def summary_path(predictions: Path) -> Path:
    """`predictions.jsonl` → `predictions.summary.json`."""
    return predictions.with_name(predictions.stem + ".summary.json")


def read_predictions(path: Path) -> list[dict]:
    """The complete lines of a predictions file (a last line cut short by a kill is left out)."""
    rows = []
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    for number, line in enumerate(lines, start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines) and not line.endswith("\n"):
                break
            raise PredictionsFileError(f"{path} line {number} is not JSON: not a predictions file") from None
    return rows


def open_for_writing(path: Path, resume: bool, overwrite: bool) -> set[int]:
    """Prepare `path` for appending: the indices already predicted (resume), or an empty file (a new run). Refuses to
    clobber an existing file unless `overwrite`, or to resume a file that is not there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if resume and path.exists():
        rows = read_predictions(path)
        done = {int(row["index"]) for row in rows}
        if len(done) != len(rows):
            raise PredictionsFileError(f"{path} holds an index twice: not a file this tool wrote")
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))  # drops a torn last line
        return done
    if path.exists() and not overwrite:
        raise PredictionsFileError(f"{path} exists: pass --resume to continue it or --overwrite to start again")
    path.write_text("")
    return set()


def append(path: Path, rows: Iterable[dict]) -> None:
    """Append whole lines and flush them to the OS (a kill after this loses none of them)."""
    with open(path, "a") as handle:
        handle.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        handle.flush()
        os.fsync(handle.fileno())


class StopSignals:
    """SIGTERM and SIGINT set `requested` for a `with` block instead of ending the process, so generation stops
    after the batch in flight with its lines written; a second signal ends the process at once (the file keeps every
    line already written). Outside the main thread it does nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        os.write(2, f"{self.requested}: stopping after the current batch (again to stop at once)\n".encode())

    def __enter__(self) -> StopSignals:
        try:
            self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        except ValueError:  # not the main thread
            self._previous = {}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
