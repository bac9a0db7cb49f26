"""The checkpoint a resume trusts, decided before anything is loaded: one saved by as many processes as this launch
has, unless --allow-world-size-change (checked first: it costs nothing), whose files match what its COMPLETE marker
recorded (lifecycle/checkpoint_manifest.py).

- `checkpoint.resume=latest`: the newest checkpoint that verifies. Newer ones that do not are renamed
  `<name>.damaged` (kept for a look; never resumed from, pruned or saved over) with a warning naming each and what
  is wrong. When none verifies, every rank stops with one line naming each one's damage, and they stay as they are
  (a relaunch refuses again rather than start the run anew).
- `checkpoint.resume=<dir>`: that checkpoint, or one line saying how it is damaged.

Every rank checks its share of the files and all of them learn every result (HostCollectives), so every rank
decides alike and a refusal is the same line on each.
"""

from __future__ import annotations

import logging
from pathlib import Path

from core.distributed import HostCollectives
from lifecycle import checkpoint_manifest
from lifecycle.checkpoint import COMPLETE, checkpoint_dirs
from lifecycle.resume import ALLOW_WORLD_SIZE_FLAG

log = logging.getLogger(__name__)
DAMAGED_SUFFIX = ".damaged"


class CheckpointError(RuntimeError):
    """No checkpoint can be trusted for this resume; the message is one line saying why and what to do."""


def damage(directory: Path, host: HostCollectives, rank: int) -> str | None:
    """How `directory` differs from its marker's record (None: it matches, or the marker records no files). A
    collective: every rank checks its share and returns the same answer."""
    manifest = checkpoint_manifest.read(directory / COMPLETE)
    problems: list[str] = []
    if not manifest.readable:
        problems = [f"its {COMPLETE} marker is unreadable"]
    elif manifest.files is not None:
        try:
            problems = checkpoint_manifest.damage(
                directory, manifest, checkpoint_manifest.share(_sizes(manifest), rank, host.size)
            )
        except OSError as error:
            problems = [f"reading it failed: {error.strerror or error}"]
    found = sorted({problem for part in host.gather(problems) for problem in part})
    return "; ".join(found) or None


def _sizes(manifest: checkpoint_manifest.Manifest) -> dict[str, int]:
    return {path: entry["bytes"] for path, entry in manifest.files.items()}


def choose(
    resume: str | None, run_dir: Path, host: HostCollectives, rank: int, allow_world_size_change: bool = False
) -> Path | None:
    """The checkpoint to resume from for `checkpoint.resume` (None: unset, or `latest` before the first save);
    CheckpointError when none can be trusted, or when the one to check was saved by another number of processes
    than `host.size` and not `allow_world_size_change`. A collective (see `damage`)."""
    if resume is None:
        return None
    if resume != "latest":
        path = Path(resume)
        if not (path / COMPLETE).is_file():
            raise CheckpointError(f"checkpoint.resume={resume}: not a complete checkpoint directory (no {COMPLETE}).")
        check_processes(path, host.size, allow_world_size_change)
        problem = damage(path, host, rank)
        if problem:
            raise CheckpointError(
                f"checkpoint.resume={resume} does not match what its {COMPLETE} marker recorded ({problem}): copy it "
                "again from its source, or resume from another checkpoint."
            )
        return _chosen(path, host.size)
    damaged: dict[Path, str] = {}
    for candidate in reversed(checkpoint_dirs(run_dir)):
        check_processes(candidate, host.size, allow_world_size_change)
        problem = damage(candidate, host, rank)
        if problem is None:
            if rank == 0:
                for directory, what in damaged.items():
                    set_aside(directory, what, candidate)
            return _chosen(candidate, host.size)
        damaged[candidate] = problem
    if not damaged:
        return None
    listed = "; ".join(f"{directory.name}: {what}" for directory, what in damaged.items())
    raise CheckpointError(
        f"no checkpoint of {run_dir} matches what its {COMPLETE} marker recorded ({listed}): copy the checkpoints "
        "again from their source, or start the run anew in another train.output_dir."
    )


def set_aside(directory: Path, what: str, resumed: Path) -> None:
    """Rename the damaged `directory` out of the run's checkpoints and warn, naming it and `resumed` (rank 0 only:
    one rename, one warning)."""
    kept = directory.with_name(directory.name + DAMAGED_SUFFIX)
    copy = 1
    while kept.exists():
        copy += 1
        kept = directory.with_name(f"{directory.name}{DAMAGED_SUFFIX}-{copy}")
    directory.rename(kept)
    log.warning(
        "checkpoint %s does not match what its %s marker recorded (%s): resuming from the older %s instead; the "
        "damaged one is renamed %s",
        directory,
        COMPLETE,
        what,
        resumed.name,
        kept.name,
    )


def saved_processes(directory: Path) -> int:
    """How many processes saved the checkpoint: its marker's record, or (a plain-text marker) its per-rank trainer
    state files."""
    recorded = checkpoint_manifest.read(directory / COMPLETE).num_processes
    return recorded if recorded is not None else len(list(directory.glob("trainer_state_rank*.pt")))


def check_processes(directory: Path, num_processes: int, allow_change: bool) -> None:
    """Refuse (CheckpointError, one line) a resume from `directory` on another number of processes than saved it,
    unless `allow_change` (the --allow-world-size-change flag)."""
    saved = saved_processes(directory)
    if saved != num_processes and not allow_change:
        raise CheckpointError(
            f"{directory} was saved by {saved} processes and this launch has {num_processes}: launch {saved} "
            f"processes to continue exactly, or add {ALLOW_WORLD_SIZE_FLAG} to continue on {num_processes} (model "
            "and optimizer as saved, the data from where it stopped, not bit-exact: docs/cluster.md)."
        )


def _chosen(directory: Path, num_processes: int) -> Path:
    """`directory`, the checkpoint chosen, after a warning when another number of processes saved it."""
    saved = saved_processes(directory)
    if saved == num_processes:
        return directory
    log.warning(
        "resuming %s, saved by %d processes, on %d (%s): model, optimizer and schedule as saved; the rest of the "
        "epoch's packs are dealt to %d ranks, so the steps from here differ from an uninterrupted run's",
        directory,
        saved,
        num_processes,
        ALLOW_WORLD_SIZE_FLAG,
        num_processes,
    )
    return directory
