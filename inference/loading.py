"""A run directory → the model to answer with, its processor and the data settings it trained with.

`--checkpoint` (`load_run`'s `checkpoint`) chooses the weights:

- `final` (default): the export `<run>/final/`: the full (or LoRA-merged) model through `from_pretrained`; an export
  that holds only `final/adapter/` (`lora.merge_on_export: false`) is the run's base with that adapter through peft.
- `latest`: the newest complete checkpoint in `<run>/checkpoints/`.
- `init`: the untrained model: the run's base (`model.name_or_path`, or its seeded random init), no adapter.
- a directory: an export (config.json), a peft adapter (adapter_config.json, loaded onto the run's base with
  `peft.PeftModel.from_pretrained`), or a training checkpoint (`checkpoints/step_*/`: the model built as training
  builds it, with the run's adapters under LoRA, and the checkpoint's tensors loaded strictly). A checkpoint of one
  process or DDP holds `model.safetensors`; one of FSDP2 under recipes/accelerate/fsdp2.yaml holds the sharded state
  dict accelerate writes through torch.distributed.checkpoint (`pytorch_model_fsdp_0/`), which DCP itself loads
  into the model here, whatever number of processes wrote it (no process group needed).

The processor is the export's when there is one, else the run's (core/config.py's `model` and `data` sections).
The pixel and frame settings are the run's `data` section (config.yaml) unless overridden; an override that differs
from training is said in one line, since answers degrade when inference resizes images differently.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from core.config import Config, load_config
from core.config_tree import ConfigError
from core.data_config import PIXEL_KEYS, DataConfig, agreed_pixel_settings
from data.pipeline import load_processor
from lifecycle.checkpoint import COMPLETE, latest_checkpoint
from modeling.build import build_model
from modeling.lora import ADAPTER_DIR, apply_lora

log = logging.getLogger(__name__)
CHECKPOINT_MODEL_FILE = "model.safetensors"
CHECKPOINT_SHARDS_DIR = "pytorch_model_fsdp_0"  # accelerate's FSDP SHARDED_STATE_DICT: a DCP dir of {"model": state}
CHECKPOINT_PREFIX = "model."  # trainer/step.py's TrainModule holds the HF model as `.model`


@dataclass
class LoadedRun:
    """The model in eval mode on `device`, its processor, the run's config and the data settings to process with."""

    model: torch.nn.Module
    processor: Any
    config: Config
    data: DataConfig  # the run's data section with any pixel / frame overrides applied
    source: str  # what was loaded, in words


def read_run_config(run_dir: Path) -> Config:
    """The resolved recipe the run wrote (config.yaml); ConfigError naming the run when there is none."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory: it has no config.yaml (train.py writes it at start).")
    return load_config(str(path))


def data_settings(cfg: Config, overrides: dict[str, Any]) -> DataConfig:
    """The run's data section (a mixture's pixel and frame settings where its sources agree, core/data_config.py's
    `agreed_pixel_settings`) with the non-None `overrides` (keys of PIXEL_KEYS); each that differs from training,
    and each on which the sources differ, is logged in one line."""
    unknown = sorted(set(overrides) - set(PIXEL_KEYS))
    if unknown:
        raise ConfigError(f"not pixel or frame settings: {unknown} (known: {list(PIXEL_KEYS)})")
    changed = {key: value for key, value in overrides.items() if value is not None}
    trained_settings, differ = agreed_pixel_settings(cfg.data)
    for key, values in differ.items():
        if key not in changed:
            log.warning(
                "data.sources trained with data.%s %s: new data is resized by the data section's %s (or pass --%s)",
                key, values, getattr(cfg.data, key), key.replace("_", "-"),
            )  # fmt: skip
    for key, value in changed.items():
        trained = getattr(trained_settings, key)
        if value != trained:
            log.warning(
                "data.%s=%s differs from training's %s: the model sees images resized unlike in training", key, value,
                trained,
            )  # fmt: skip
    settings = dataclasses.replace(trained_settings, **changed)
    settings.validate()
    return settings


def _base_model(cfg: Config, dtype: torch.dtype) -> torch.nn.Module:
    """The run's untrained model: `model.name_or_path`, or the random init train.py seeds with `train.seed`."""
    return build_model(dataclasses.replace(cfg.model, dtype=str(dtype).removeprefix("torch.")), seed=cfg.train.seed)


def _from_adapter(cfg: Config, adapter_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(_base_model(cfg, dtype), str(adapter_dir))


def _from_checkpoint(cfg: Config, directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The model a training checkpoint holds: built as train.py builds it (fp32, the run's adapters under LoRA),
    the checkpoint's tensors loaded strictly (under LoRA, the adapters and fully trained parts over the seeded base)."""
    weights, shards = directory / CHECKPOINT_MODEL_FILE, directory / CHECKPOINT_SHARDS_DIR
    if not weights.is_file() and not shards.is_dir():
        raise ConfigError(
            f"{directory} holds neither {CHECKPOINT_MODEL_FILE} nor the sharded {CHECKPOINT_SHARDS_DIR}/ of an FSDP2 "
            "run: it is not a complete training checkpoint."
        )
    model = _base_model(cfg, torch.float32)
    if cfg.lora is not None:
        apply_lora(model, cfg.lora, torch.float32)
    if weights.is_file():
        state = {key.removeprefix(CHECKPOINT_PREFIX): value for key, value in load_file(weights).items()}
        model.load_state_dict(state, strict=True)
    else:
        _load_shards(model, shards)
    return model.to(dtype)


def _load_shards(model: torch.nn.Module, shards: Path) -> None:
    """Load an FSDP2 checkpoint's sharded model state (`shards`: the DCP directory accelerate's `save_state` writes,
    {"model": the training module's state dict}) into `model`'s own tensors, in place, with DCP's loader: it
    reassembles each tensor from the shards of however many processes saved it. Strict: the checkpoint's tensors
    are exactly the model's state dict (under LoRA the adapters and fully trained parts, as training saves them)."""
    import torch.distributed.checkpoint as dcp

    state = {CHECKPOINT_PREFIX + key: value for key, value in model.state_dict().items()}
    saved = dcp.FileSystemReader(str(shards)).read_metadata().state_dict_metadata  # flat: "model." + each key
    saved = {key.removeprefix("model.") for key in saved}
    missing, unexpected = sorted(set(state) - saved), sorted(saved - set(state))
    if missing or unexpected:
        raise ConfigError(
            f"{shards} does not hold this run's model: {len(missing)} tensors missing (e.g. {missing[:2]}), "
            f"{len(unexpected)} unexpected (e.g. {unexpected[:2]})."
        )
    with warnings.catch_warnings():  # no_dist is the point here, not a fallback to warn about
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"model": state}, checkpoint_id=str(shards), no_dist=True)


def _from_export(directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(directory, dtype=dtype)


def resolve_checkpoint(run_dir: Path, checkpoint: str) -> Path | None:
    """The directory `checkpoint` names (module docstring); None for `init`."""
    if checkpoint == "init":
        return None
    if checkpoint == "final":
        directory = run_dir / "final"
        if not directory.is_dir():
            raise ConfigError(f"{run_dir} has no final/ export yet: pass --checkpoint latest or a checkpoint dir.")
        return directory
    if checkpoint == "latest":
        directory = latest_checkpoint(run_dir)
        if directory is None:
            raise ConfigError(f"{run_dir} has no complete checkpoint in checkpoints/.")
        return directory
    directory = Path(checkpoint)
    if not directory.is_dir():
        raise ConfigError(f"--checkpoint {checkpoint}: not final, latest, init or a directory.")
    return directory


def load_model(cfg: Config, directory: Path | None, dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
    """(model, what it is in words) for a resolved checkpoint directory (None: the untrained model)."""
    if directory is None:
        return _base_model(cfg, dtype), "the untrained model (the run's base, no training)"
    if (directory / "adapter_config.json").is_file():
        return _from_adapter(cfg, directory, dtype), f"the run's base + the peft adapter {directory}"
    if (directory / "config.json").is_file():
        return _from_export(directory, dtype), f"the export {directory}"
    if (directory / ADAPTER_DIR / "adapter_config.json").is_file():
        adapter = directory / ADAPTER_DIR
        return _from_adapter(cfg, adapter, dtype), f"the run's base + the peft adapter {adapter}"
    if (directory / COMPLETE).is_file() or (directory / CHECKPOINT_MODEL_FILE).is_file():
        return _from_checkpoint(cfg, directory, dtype), f"the training checkpoint {directory}"
    raise ConfigError(f"{directory} holds no export (config.json), peft adapter or training checkpoint.")


def load_run(
    run_dir: str | Path,
    checkpoint: str = "final",
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    data_overrides: dict[str, Any] | None = None,
) -> LoadedRun:
    """The run's model (module docstring) in `dtype` (None: the run's model.dtype on CUDA, float32 elsewhere) on
    `device`, in eval mode, with its processor and data settings."""
    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    if dtype is None:
        dtype = getattr(torch, cfg.model.dtype) if torch.device(device).type == "cuda" else torch.float32
    directory = resolve_checkpoint(run_dir, checkpoint)
    model, source = load_model(cfg, directory, dtype)
    model.to(device).eval()
    processor_dir = directory if directory is not None and (directory / "processor_config.json").is_file() else None
    if processor_dir is not None:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(processor_dir)
    else:
        processor = load_processor(cfg.model, cfg.data)
    log.info("generating with %s", source)
    return LoadedRun(model, processor, cfg, data_settings(cfg, data_overrides or {}), source)
