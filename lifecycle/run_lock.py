"""One trainer per run directory: `<run dir>/run.lock`, held by the main process for the run's lifetime.

Two trainers on one directory would interleave metrics.jsonl and overwrite each other's checkpoints and export, so
a second one refuses at once, naming the holder (host, pid, start time). The lock is an `flock` on run.lock, which
the kernel releases when its holder dies (kill -9 included): a dead run's lock is simply free, and the next run takes
it over with a log line naming the run it recorded. The file records the holder as JSON and is emptied on a clean
release, so only a holder that died leaves its record behind.

The holder refreshes the file's modification time every HEARTBEAT_S (a daemon thread). Two cases need it:
- filesystems whose flock is local to one host (Lustre's `localflock`, BeeGFS by default): a free flock over a
  record of another host refreshed within STALE_S means a live run there, and is refused;
- filesystems without flock (ENOLCK, EOPNOTSUPP, ENOSYS: Lustre mounted `noflock`, some NFS setups): the lock is
  the file itself, created with O_EXCL and deleted on release; a leftover file is taken over once its holder is
  known dead (same host, its pid gone) or its heartbeat is older than STALE_S (a lost node). That takeover has a
  race (two runs replacing one stale file in the same instant); the holder checks after writing that the record is
  its own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

import psutil

from lifecycle.run_files import LOCK_FILE

log = logging.getLogger(__name__)
HEARTBEAT_S = 15.0  # how often the holder refreshes the lock file's modification time
STALE_S = 4 * HEARTBEAT_S  # a lock file older than this names a holder that stopped (a lost node)
NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}  # the filesystem has no flock (EOPNOTSUPP == ENOTSUP)


class RunLockError(RuntimeError):
    """The run directory cannot be this run's: another live run holds it (or its lock file cannot be made)."""


def _this_process() -> dict:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "pid_started": psutil.Process(pid).create_time(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _read_record(path: Path) -> dict | None:
    """The holder recorded in `path`, or None (no file, empty, or torn mid-write)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def lock_age_s(path: Path) -> float:
    """Seconds since `path` was last refreshed (its modification time)."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def _alive_here(record: dict) -> bool:
    """Whether the process `record` names runs on this host (same pid and start time: not a reused pid)."""
    try:
        process = psutil.Process(int(record.get("pid", -1)))
        return abs(process.create_time() - float(record.get("pid_started", 0))) < 1.0
    except (psutil.Error, ValueError, TypeError):
        return False


def _describe(record: dict | None) -> str:
    if not record:
        return "a process that has not written its name yet"
    return f"host {record.get('host', '?')} pid {record.get('pid', '?')} (started {record.get('started', '?')})"


class RunLock:
    """The run directory's lock, held from `acquire` to `release` (use `hold`)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self.fd: int | None = None
        self.uses_flock = True
        self.record = _this_process()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self) -> None:
        """Take the lock or raise RunLockError naming the holder; log a takeover of a dead holder's lock."""
        fd, created = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunLockError(self._refusal(_read_record(self.path))) from None
        except OSError as error:
            os.close(fd)
            if error.errno not in NO_FLOCK:
                raise
            if created:  # without flock the file's existence is the lock: this probe must not hold it
                self.path.unlink()
            log.warning(
                "%s: this filesystem has no flock (%s); the lock is the file itself, with a heartbeat",
                self.path,
                error.strerror,
            )
            self.uses_flock = False
            self._acquire_without_flock()
        else:
            self.fd = fd
            previous = _read_record(self.path)
            if previous and previous.get("host") != self.record["host"] and lock_age_s(self.path) < STALE_S:
                self._unlock()
                raise RunLockError(
                    self._refusal(previous)
                    + f" Its lock was refreshed {lock_age_s(self.path):.0f} s ago: flock on this filesystem does not "
                    "reach across hosts."
                )
            self._write_record()
            if previous:
                log.warning("took over the run-directory lock of %s, which no longer runs", _describe(previous))
        self._start_heartbeat()

    def _open(self) -> tuple[int, bool]:
        """The lock file open for writing, and whether this call created it."""
        while True:
            with contextlib.suppress(FileExistsError):
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            with contextlib.suppress(FileNotFoundError):  # deleted in between by a holder without flock
                return os.open(self.path, os.O_RDWR), False

    def _refusal(self, holder: dict | None) -> str:
        return (
            f"train.output_dir={self.path.parent} is in use by another run: {_describe(holder)} holds {self.path}. "
            "Wait for it to end, stop it, or choose another train.output_dir."
        )

    def _acquire_without_flock(self) -> None:
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            previous = _read_record(self.path)
            same_host = bool(previous) and previous.get("host") == self.record["host"]
            dead = (same_host and not _alive_here(previous)) or lock_age_s(self.path) >= STALE_S
            if not dead:
                raise RunLockError(self._refusal(previous)) from None
            partial = self.path.with_name(f"{self.path.name}.{self.record['host']}.{self.record['pid']}")
            partial.write_text(json.dumps(self.record) + "\n")
            partial.replace(self.path)
            if _read_record(self.path) != self.record:  # another run replaced the stale file in the same instant
                raise RunLockError(self._refusal(_read_record(self.path))) from None
            self.fd = os.open(self.path, os.O_RDWR)
            log.warning("took over the run-directory lock of %s, which no longer runs", _describe(previous))
            return
        self._write_record()

    def _write_record(self) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(self.record) + "\n").encode(), 0)
        os.fsync(self.fd)

    def _start_heartbeat(self) -> None:
        self._heartbeat = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):  # a filesystem hiccup: the next beat tries again
                os.utime(self.fd)

    def _unlock(self) -> None:
        if self.fd is None:
            return
        if self.uses_flock:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def release(self) -> None:
        """Mark a clean end (an emptied file; no file without flock) and unlock. Safe to call twice, and from
        another thread (a forced exit)."""
        self._stop.set()
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if self.uses_flock:
                os.ftruncate(self.fd, 0)
            elif _read_record(self.path) == self.record:
                self.path.unlink()
        self._unlock()


@contextlib.contextmanager
def hold(run_dir: Path, is_main_process: bool, host):
    """Hold `run_dir`'s lock (main process) for the `with` block; every rank raises the same RunLockError when
    another run holds it. `host`: core.distributed.HostCollectives, which tells the other ranks the outcome.
    Yields the lock (None on other ranks)."""
    lock, refusal = None, None
    if is_main_process:
        lock = RunLock(run_dir)
        try:
            lock.acquire()
        except RunLockError as error:
            lock, refusal = None, str(error)
        except OSError as error:  # told to every rank too: a rank left waiting would hang
            lock, refusal = None, f"cannot lock {run_dir / LOCK_FILE}: {error.strerror or error}"
    refusal = host.gather(refusal)[0]
    if refusal is not None:
        raise RunLockError(refusal)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
