"""Checkpoints for an exact resume, and the final inference export.

A checkpoint `<run dir>/checkpoints/step_00000100/` holds accelerate's `save_state` (model, optimizer, scheduler,
RNG of every rank) plus one `trainer_state_rank<r>.pt` per rank (optimizer step, that rank's data-loader position).
A `COMPLETE` marker is written last (and removed first when pruning), so a run killed mid-save or mid-prune never
resumes from a torn checkpoint. The export `<run dir>/final/` is `save_pretrained` + the processor:
`AutoModelForImageTextToText.from_pretrained` and `AutoProcessor.from_pretrained` load it for inference. It is
written to `final.partial/` and renamed, so `final/` exists only once complete and `--resume` redoes a killed one.
With LoRA a checkpoint's model state is the adapters and fully trained parts only (training/lora.py), and the export
adds `final/adapter/` in peft's format; `final/` holds the merged model unless `lora.merge_on_export` is false.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from training import lora
from training.config import CheckpointConfig, LoraConfig

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint to resume from: None (`checkpoint.resume` unset), the latest complete one in this run's
    directory (`latest`; None when there is none yet, so a first launch and a relaunch share one command), or a
    given checkpoint directory (an error when it is not a complete checkpoint)."""
    if resume is None:
        return None
    if resume == "latest":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"checkpoint.resume={resume}: not a complete checkpoint directory (no {COMPLETE}).")
    return path


class Checkpointer:
    """Saves and restores full training state; prunes to the newest `keep_last` checkpoints."""

    def __init__(self, accelerator: Accelerator, run_dir: Path, cfg: CheckpointConfig):
        self.accelerator = accelerator
        self.run_dir = run_dir
        self.cfg = cfg

    def _state_file(self, directory: Path) -> Path:
        return directory / f"trainer_state_rank{self.accelerator.process_index}.pt"

    def save(self, step: int, data_state: dict[str, Any], timing: dict[str, float]) -> Path:
        """Save everything after optimizer step `step`; `data_state` is this rank's loader `state_dict()`, `timing`
        this rank's throughput totals so far (the summary describes the whole run, across resumes)."""
        directory = self.run_dir / "checkpoints" / f"step_{step:08d}"
        if self.accelerator.is_main_process and directory.exists():  # a torn save of this step, killed earlier
            shutil.rmtree(directory)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(directory))
        torch.save({"step": step, "data": data_state, "timing": timing}, self._state_file(directory))
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            (directory / COMPLETE).write_text(f"{step}\n")
            for old in checkpoint_dirs(self.run_dir)[: -self.cfg.keep_last]:
                (old / COMPLETE).unlink()
                shutil.rmtree(old)
        self.accelerator.wait_for_everyone()
        return directory

    def load(self, directory: Path) -> tuple[int, dict[str, Any]]:
        """Restore model/optimizer/scheduler/RNG from `directory`; returns (step, this rank's trainer state:
        "data", the loader position, and "timing", the throughput totals, where the checkpoint holds them)."""
        self.accelerator.load_state(str(directory))
        state_file = self._state_file(directory)
        if not state_file.is_file():
            raise FileNotFoundError(
                f"{state_file} is missing: the checkpoint was written by a run with fewer processes. "
                "Resume with the same number of processes."
            )
        state = torch.load(state_file, weights_only=False)
        return state["step"], state


def export_complete(out_dir: Path) -> bool:
    return out_dir.is_dir()


def export(
    accelerator: Accelerator,
    model: torch.nn.Module,
    processor: Any,
    out_dir: Path,
    dtype: str,
    lora_cfg: LoraConfig | None = None,
    base_model: str | None = None,
) -> Path:
    """Write the inference export: the HF model's weights in `dtype` (safetensors), its config, and the processor.

    `model` is the prepared training module (`step.TrainModule`): its `.model` is the HF model; the full state
    dict is gathered from every rank (FSDP) before the main process writes it to `<out_dir>.partial` and renames
    it to `out_dir` (see `export_complete`). With LoRA (`lora_cfg`) the adapter goes to `<out_dir>/adapter/` in
    peft's format (for `base_model`, the run's `model.name_or_path`) and, with `lora.merge_on_export`, the model
    with the adapters merged into its weights to `out_dir` itself; the processor always goes to `out_dir`.
    """
    hf_model = accelerator.unwrap_model(model).model
    with lora.full_state_dict(hf_model) if lora_cfg is not None else contextlib.nullcontext():
        state = accelerator.get_state_dict(model)
    partial = out_dir.with_name(out_dir.name + ".partial")
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        target = getattr(torch, dtype)
        weights = {key.removeprefix("model."): value for key, value in state.items()}
        if lora_cfg is not None:
            lora.export_adapter(partial / lora.ADAPTER_DIR, weights, hf_model, lora_cfg, base_model, target)
        if lora_cfg is None or lora_cfg.merge_on_export:
            if lora_cfg is not None:
                weights = lora.merged_state(weights, hf_model)
            weights = {k: v.to(target) if v.is_floating_point() else v for k, v in weights.items()}
            hf_model.save_pretrained(partial, state_dict=weights)
            # save_pretrained records the dtype of the (fp32 master) parameters; the weights on disk are `dtype`.
            hf_model.config.dtype = dtype
            hf_model.config.save_pretrained(partial)
        processor.save_pretrained(partial)
        shutil.rmtree(out_dir, ignore_errors=True)
        partial.rename(out_dir)
        log.info("exported %s", out_dir)
    accelerator.wait_for_everyone()
    return out_dir
