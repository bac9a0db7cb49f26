"""Checkpoints for an exact resume, and the final inference export.

A checkpoint `<run dir>/checkpoints/step_00000100/` holds accelerate's `save_state` (model, optimizer, scheduler,
RNG of every rank) plus one `trainer_state_rank<r>.pt` per rank (optimizer step, that rank's data-loader position).
A `COMPLETE` marker is written last, after every file is synced to disk (and removed first when pruning), so a run
killed mid-save or mid-prune, or a node lost just after, never resumes from a torn checkpoint; a torn one is removed
at the next save. The marker records every file's size and checksum (lifecycle/checkpoint_manifest.py), which a
resume checks before it trusts the checkpoint (lifecycle/trusted_resume.py). The export `<run dir>/final/` is
`save_pretrained` + the processor: `AutoModelForImageTextToText.from_pretrained` and `AutoProcessor.from_pretrained`
load it for inference. It is written to `final.partial/` and renamed, so `final/` exists only once complete and
`--resume` redoes a killed one.

A write that fails (a full disk or quota, an I/O error: torch.save and safetensors report them as RuntimeError and
SafetensorError, not OSError) removes what it wrote, leaves every complete checkpoint as it was, and raises
WriteError on every rank: one line naming the path, the error, the bytes needed and the bytes free there.

With LoRA a checkpoint's model state is the adapters and fully trained parts only (modeling/lora.py), and the export
adds `final/adapter/` in peft's format; `final/` holds the merged model unless `lora.merge_on_export` is false.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from core.config import CheckpointConfig, LoraConfig
from core.data_config import DataConfig
from core.distributed import HostCollectives
from data.pipeline import processor_for_export
from lifecycle import checkpoint_manifest
from modeling import lora

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


def incomplete_dirs(run_dir: Path) -> list[Path]:
    """Checkpoint directories without their COMPLETE marker: saves that a kill, a forced exit or a failed write
    interrupted."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if STEP_DIR.match(p.name) and not (p / COMPLETE).is_file()]


def latest_checkpoint(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


class WriteError(RuntimeError):
    """A checkpoint or the export could not be written; the message is one line saying what to do."""


def tree_nbytes(path: Path) -> int:
    """Bytes of the files under `path` (0 when it does not exist)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def state_nbytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the model's state and the optimizer's state tensors: what a checkpoint holds, about."""
    tensors = [*module.state_dict().values()]
    tensors += [v for state in optimizer.state_dict()["state"].values() for v in state.values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes} bytes ({nbytes / scale:.1f} {unit})"
    return f"{nbytes} bytes"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(directory: Path) -> None:
    """fsync every file and directory under `directory`, and itself: the data is on disk before the marker (or the
    rename) that declares it complete, so a node that loses power keeps no such declaration over lost data."""
    for path in [*directory.rglob("*"), directory]:
        _fsync(path)


def write_failure(what: str, path: Path, error: BaseException, needed: int) -> str:
    """The one-line report of a failed write of `what` at `path`; the traceback is logged too where free space does
    not explain the error."""
    free = free_bytes(path)
    if free >= needed:
        log.error("writing %s %s failed", what, path, exc_info=error)
    detail = " ".join(str(error).split()) or type(error).__name__
    return (
        f"writing {what} {path} failed ({type(error).__name__}: {detail}); it needs about {_size(needed)} and "
        f"{_size(free)} are free there"
    )


class Checkpointer:
    """Saves and restores full training state; prunes to the newest `keep_last` checkpoints.

    `host` agrees on a failed write across ranks; `estimate_nbytes()` is the size of a checkpoint when none is on
    disk yet to measure (for the error message)."""

    def __init__(
        self,
        accelerator: Accelerator,
        run_dir: Path,
        cfg: CheckpointConfig,
        host: HostCollectives,
        estimate_nbytes: Callable[[], int] = lambda: 0,
    ):
        self.accelerator = accelerator
        self.run_dir = run_dir
        self.cfg = cfg
        self.host = host
        self.estimate_nbytes = estimate_nbytes

    def _state_file(self, directory: Path, rank: int | None = None) -> Path:
        return directory / f"trainer_state_rank{self.accelerator.process_index if rank is None else rank}.pt"

    def save(self, step: int, data_state: dict[str, Any], timing: dict[str, float]) -> Path:
        """Save everything after optimizer step `step`; `data_state` is this rank's loader `state_dict()`, `timing`
        this rank's throughput totals so far (the summary describes the whole run, across resumes). Raises
        WriteError on every rank when a rank's write fails."""
        directory = self.run_dir / "checkpoints" / f"step_{step:08d}"
        main = self.accelerator.is_main_process
        if main:  # torn saves of killed launches (this run holds the run lock: no one else writes here)
            for torn in incomplete_dirs(self.run_dir):
                shutil.rmtree(torn, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        failure = None
        try:
            self.accelerator.save_state(str(directory))
            torch.save({"step": step, "data": data_state, "timing": timing}, self._state_file(directory))
        except Exception as error:  # every rank must reach the agreement below, whatever the write raised
            failure = write_failure("the checkpoint", directory, error, self._checkpoint_nbytes())
        self._agree_or_raise(failure, directory)
        files = self._describe_files(directory)
        if main:
            try:
                _sync_tree(directory)
                (directory / COMPLETE).write_text(
                    checkpoint_manifest.render(step, self.accelerator.num_processes, files)
                )
                _fsync(directory / COMPLETE)
                _fsync(directory)
            except OSError as error:
                failure = write_failure("the checkpoint", directory, error, self._checkpoint_nbytes())
        self._agree_or_raise(failure, directory)
        if main:
            for old in checkpoint_dirs(self.run_dir)[: -self.cfg.keep_last]:
                (old / COMPLETE).unlink()
                shutil.rmtree(old)
        self.accelerator.wait_for_everyone()
        return directory

    def _describe_files(self, directory: Path) -> dict[str, dict]:
        """Every file of the saved `directory` with its size and checksum, for the marker: the main process lists
        them, every rank describes its share (checkpoint_manifest.share), and all of them get the whole record."""
        sizes = self.host.gather(
            checkpoint_manifest.checkpoint_files(directory, COMPLETE) if self.accelerator.is_main_process else None
        )[0]
        rank, size = self.accelerator.process_index, self.accelerator.num_processes
        failure, entries = None, {}
        try:
            mine = checkpoint_manifest.share(sizes, rank, size)
            entries = checkpoint_manifest.describe(directory, mine, self.cfg.checksums)
        except OSError as error:
            failure = write_failure("the checkpoint", directory, error, self._checkpoint_nbytes())
        self._agree_or_raise(failure, directory)
        return {path: entry for part in self.host.gather(entries) for path, entry in part.items()}

    def _checkpoint_nbytes(self) -> int:
        latest = latest_checkpoint(self.run_dir)
        return tree_nbytes(latest) if latest is not None else self.estimate_nbytes()

    def _agree_or_raise(self, failure: str | None, directory: Path) -> None:
        """Every rank's outcome; on a failure anywhere, the partial checkpoint goes and every rank raises it."""
        failures = [f for f in self.host.gather(failure) if f]
        if not failures:
            return
        if self.accelerator.is_main_process:
            shutil.rmtree(directory, ignore_errors=True)
        latest = latest_checkpoint(self.run_dir)
        kept = f"the latest complete checkpoint, {latest}, is intact" if latest else "no earlier checkpoint exists"
        raise WriteError(
            f"{failures[0]}. The partial checkpoint is removed and {kept}: free space (or fix the error), then "
            "relaunch with --resume."
        )

    def load(self, directory: Path) -> tuple[int, dict[str, Any]]:
        """Restore model/optimizer/scheduler/RNG from `directory`; returns (step, this rank's trainer state:
        "data", the loader position, and "timing", the throughput totals, where the checkpoint holds them).

        A checkpoint of another number of processes (accepted by lifecycle/trusted_resume.py) gives a rank without
        a state file of its own rank 0's: the data position is the same on every rank, and the timing totals are
        only a rate's inputs. A rank without its RNG file keeps its seeded generators (accelerate logs it)."""
        self.accelerator.load_state(str(directory))
        state_file = self._state_file(directory)
        if not state_file.is_file():
            state_file = self._state_file(directory, rank=0)
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
    host: HostCollectives,
    lora_cfg: LoraConfig | None = None,
    base_model: str | None = None,
    data_cfg: DataConfig | None = None,
) -> Path:
    """Write the inference export: the HF model's weights in `dtype` (safetensors), its config, its generation config
    (stopping at the chat template's turn end), and the processor with the run's pixel bounds (`data_cfg`).

    `model` is the prepared training module (`step.TrainModule`): its `.model` is the HF model; the full state
    dict is gathered from every rank (FSDP) before the main process writes it to `<out_dir>.partial` and renames
    it to `out_dir` (see `export_complete`). With LoRA (`lora_cfg`) the adapter goes to `<out_dir>/adapter/` in
    peft's format (for `base_model`, the run's `model.name_or_path`) and, with `lora.merge_on_export`, the model
    with the adapters merged into its weights to `out_dir` itself; the processor always goes to `out_dir`. A failed
    write removes the partial export and raises WriteError on every rank (`host` tells them).
    """
    hf_model = accelerator.unwrap_model(model).model
    with lora.full_state_dict(hf_model) if lora_cfg is not None else contextlib.nullcontext():
        state = accelerator.get_state_dict(model)
    partial = out_dir.with_name(out_dir.name + ".partial")
    failure = None
    if accelerator.is_main_process:
        target = getattr(torch, dtype)
        weights = {key.removeprefix("model."): value for key, value in state.items()}
        if data_cfg is not None:
            processor = processor_for_export(processor, data_cfg)
        try:
            _write_export(hf_model, weights, processor, partial, out_dir, target, lora_cfg, base_model)
        except Exception as error:  # every rank must reach the agreement below
            size = torch.empty((), dtype=target).element_size()
            needed = sum(t.numel() * (size if t.is_floating_point() else t.element_size()) for t in weights.values())
            failure = write_failure("the export", partial, error, needed)
            shutil.rmtree(partial, ignore_errors=True)
    failures = [f for f in host.gather(failure) if f]
    if failures:
        raise WriteError(
            f"{failures[0]}. The partial export is removed and the checkpoints are intact: free space (or fix the "
            "error), then relaunch with --resume, which writes the export again."
        )
    return out_dir


def set_serving_generation_config(hf_model, tokenizer) -> None:
    """The model's generation config as serving engines read it: its EOS ids plus the chat template's turn end
    (`<|im_end|>`, where every assistant turn stops) and the tokenizer's pad id; the rest as the model had it."""
    config = hf_model.generation_config
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    turn_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = [i for i in dict.fromkeys([*eos, turn_end if isinstance(turn_end, int) else None]) if i is not None]
    config.eos_token_id = eos[0] if len(eos) == 1 else eos
    if tokenizer.pad_token_id is not None:
        config.pad_token_id = tokenizer.pad_token_id


def _write_export(
    hf_model,
    weights: dict,
    processor: Any,
    partial: Path,
    out_dir: Path,
    target: torch.dtype,
    lora_cfg: LoraConfig | None,
    base_model: str | None,
) -> None:
    """Write `partial` (the adapter with LoRA; the weights in `target`, merged with LoRA unless told not to; the
    processor), sync it, and rename it to `out_dir`."""
    shutil.rmtree(partial, ignore_errors=True)
    if lora_cfg is not None:
        lora.export_adapter(partial / lora.ADAPTER_DIR, weights, hf_model, lora_cfg, base_model, target)
    if lora_cfg is None or lora_cfg.merge_on_export:
        if lora_cfg is not None:
            weights = lora.merged_state(weights, hf_model)
        weights = {k: v.to(target) if v.is_floating_point() else v for k, v in weights.items()}
        set_serving_generation_config(hf_model, processor.tokenizer)
        hf_model.save_pretrained(partial, state_dict=weights)
        # save_pretrained records the dtype of the (fp32 master) parameters; the weights on disk are `target`.
        hf_model.config.dtype = str(target).removeprefix("torch.")
        hf_model.config.save_pretrained(partial)
    processor.save_pretrained(partial)
    _sync_tree(partial)
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)
    _fsync(out_dir.parent)  # the rename itself
    log.info("exported %s", out_dir)
