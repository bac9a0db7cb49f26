"""Experiment tracking through accelerate's trackers: wandb online when logged in, offline otherwise, or none.

Offline runs land in `<run dir>/wandb/` and upload later with `wandb sync <that dir>/offline-run-*`.
"""

from __future__ import annotations

import importlib.util
import logging
import netrc
import os
from pathlib import Path

from accelerate import Accelerator

from core import config_tree
from core.config import Config

log = logging.getLogger(__name__)


def log_with(cfg: Config) -> list[str] | None:
    """The `log_with` argument of `Accelerator` for the recipe's `logging.report_to`."""
    return None if cfg.logging.report_to == "none" else [cfg.logging.report_to]


def wandb_logged_in() -> bool:
    """Whether wandb has credentials (WANDB_API_KEY or a ~/.netrc entry for its host); reads no network."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def wandb_mode() -> str:
    """WANDB_MODE when the user set it; else online with credentials and offline without."""
    return os.environ.get("WANDB_MODE") or ("online" if wandb_logged_in() else "offline")


def start(accelerator: Accelerator, cfg: Config, run_dir: Path) -> Path | None:
    """Start the recipe's trackers on the main process (call once, after `Accelerator(log_with=log_with(cfg))`).

    Returns the directory of the wandb run files (None when not tracking).
    """
    if cfg.logging.report_to == "none":
        return None
    if importlib.util.find_spec("wandb") is None:
        raise RuntimeError("logging.report_to=wandb but wandb is not installed: pip install wandb, or report_to=none.")
    mode = wandb_mode()
    wandb_root = run_dir / "wandb"
    init = {
        "name": cfg.logging.run_name or run_dir.name,
        "dir": str(run_dir),
        "group": cfg.logging.group,
        "tags": list(cfg.logging.tags),
        "mode": mode,
    }
    if accelerator.is_main_process:
        wandb_root.mkdir(parents=True, exist_ok=True)
    accelerator.init_trackers(cfg.logging.project, config=config_tree.to_dict(cfg), init_kwargs={"wandb": init})
    if not accelerator.is_main_process:
        return None
    run = accelerator.get_tracker("wandb", unwrap=True)
    files_dir = Path(run.dir).parent if getattr(run, "dir", None) else wandb_root
    if mode == "offline":
        log.warning("wandb is offline (no login found); upload later with: wandb sync %s", files_dir)
    return files_dir
