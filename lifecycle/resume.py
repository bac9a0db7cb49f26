"""What `--resume` checks and records about the config: a resumed run equals the uninterrupted one only with the
settings it was started with, so changes that break that are refused unless forced, and every change is recorded.

The run's first launch writes `config.yaml`; a resume never overwrites it. A resume with any change writes
`config.resume-step<N>.yaml` (the config really used from step N on) and logs the changed keys.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from core import config_tree
from core.config import Config
from core.config_tree import ConfigError

log = logging.getLogger(__name__)
ALLOW_FLAG = "--allow-config-change"
# the other flag of --resume, read by lifecycle/trusted_resume.py; declared here, where train.py's argument parser reads
# it without importing the checkpoint code
ALLOW_WORLD_SIZE_FLAG = "--allow-world-size-change"
# Keys whose change leaves every step's math as it was: where the run writes and logs, how often it checkpoints or
# evaluates (train.generate_*: greedy answers draw no random numbers), how far it goes (train.max_steps: the schedule
# then stretches to the new end), how data is fetched, what is recomputed or compiled (train.compile: the same math,
# only inductor's fused rounding differs), whether the memory estimate is checked, what the export holds
# (lora.merge_on_export).
SAFE_TO_CHANGE = (
    "logging.",
    "checkpoint.",
    "train.output_dir",
    "train.max_steps",
    "train.eval_every",
    "train.eval_batches",
    "train.generate_",
    "data.num_workers",
    "data.num_proc",
    "data.cache_dir",
    "model.gradient_checkpointing_llm",
    "model.gradient_checkpointing_vision",
    "train.compile",
    "train.memory_check",
    "lora.merge_on_export",
)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}{key}."))
    return flat


def config_changes(before: dict, after: dict) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (before, after)} for every leaf that differs (absent leaves read as None)."""
    old, new = _flat(before), _flat(after)
    return {k: (old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}


def _describe(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())


def check_config(cfg: Config, run_dir: Path, resuming: bool, allow_changes: bool) -> dict[str, tuple[Any, Any]]:
    """The changes of `cfg` against the run's config.yaml when resuming ({} otherwise); ConfigError naming the keys
    whose change breaks exactness, unless `allow_changes` (the --allow-config-change flag)."""
    saved = run_dir / "config.yaml"
    if not resuming or not saved.is_file():
        return {}
    current = config_tree.to_dict(cfg)
    before = yaml.safe_load(saved.read_text()) or {}
    before.setdefault("checkpoint", {})["resume"] = current["checkpoint"]["resume"]  # --resume itself
    changes = config_changes(before, current)
    # A key the run's version did not have yet, now at its default (e.g. parallel.context=1), is what the run did.
    saved_keys, defaults = _flat(before), _flat(config_tree.to_dict(Config()))
    changes = {k: v for k, v in changes.items() if k in saved_keys or v[1] != defaults.get(k, v[0])}
    breaking = {k: v for k, v in changes.items() if not k.startswith(SAFE_TO_CHANGE)}
    if breaking and not allow_changes:
        raise ConfigError(
            f"--resume with settings that differ from {saved}: {_describe(breaking)}. The resumed run would no "
            f"longer equal the one started; relaunch with the run's settings, or add {ALLOW_FLAG} to use the new ones."
        )
    if breaking:
        log.warning("resuming with changed settings (%s): %s", ALLOW_FLAG, _describe(breaking))
    if len(changes) > len(breaking):
        log.info("resuming with: %s", _describe({k: v for k, v in changes.items() if k not in breaking}))
    return changes


def record_config(cfg: Config, run_dir: Path, resume_step: int | None, changes: dict) -> Path | None:
    """Write config.yaml on a fresh run, config.resume-step<N>.yaml on a resume that changed anything; the path."""
    if resume_step is None or not (run_dir / "config.yaml").is_file():
        path = run_dir / "config.yaml"
    elif changes:
        path = run_dir / f"config.resume-step{resume_step:08d}.yaml"
    else:
        return None
    config_tree.save(cfg, path)
    return path
