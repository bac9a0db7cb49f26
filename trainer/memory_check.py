"""Whether a run fits the devices it has, checked before the model is built (trainer/memory_estimate.py's estimate
against each GPU's memory, or on a CPU-only host the RAM available), and the overrides that would make it fit.

train.py calls `check(cfg, accelerator)` first (the estimate resolves `auto` settings, the checkpointing's included,
as trainer/defaults.py will for this launch): with `train.memory_check: true` (the default) a run that cannot fit
stops with one line (a `MemoryFitError`) naming the estimate, the device and the overrides that fit; `warn` logs that
line and goes on; `false` skips the check. scripts/estimate_memory.py and scripts/inspect_data.py print
`fit_report`: the estimate held against given GPUs, with the overrides that fit (and with `auto` checkpointing, what
it resolves to on each).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from torch import nn

from core.config import Config, LoraConfig
from data.pipeline import local_processes
from trainer import activation_checkpointing
from trainer.memory_estimate import (
    GIB,
    MemoryEstimate,
    Sharding,
    checkpointed_blocks,
    estimate_memory,
    meta_model,
    stack_blocks,
)

log = logging.getLogger(__name__)
FSDP2_LAUNCH = "accelerate launch --config_file recipes/accelerate/fsdp2.yaml --num_processes {n} train.py ..."
MAX_SUGGESTED_GPUS = 64
SUGGESTED_LORA_RANK = 16
SMALLEST_SUGGESTED_PACK = 1024


class MemoryFitError(RuntimeError):
    """The run's memory estimate exceeds the device's memory (one line: the numbers and the overrides that fit; empty
    on the processes other than the main one, which print nothing)."""


@dataclass(frozen=True)
class Target:
    """The device memory a run must fit, per process."""

    capacity_gib: float
    name: str  # what holds it: "each NVIDIA H100 80GB HBM3", "the RAM available to each of 2 processes (no CUDA)"
    on_cuda: bool


REFERENCE_GPUS = (Target(79.2, "an 80 GB H100", True), Target(139.8, "a 141 GB H200", True))  # total_memory, GiB


@dataclass(frozen=True)
class Suggestion:
    """An override (or launch) that changes the estimate, and the estimate with it."""

    change: str
    estimate: MemoryEstimate


def local_target(on_cuda: bool, device_index: int = 0, local_processes: int = 1) -> Target:
    """This machine's memory per process: the CUDA device's total memory, else the RAM available now shared by the
    host's `local_processes`."""
    if on_cuda:
        import torch

        props = torch.cuda.get_device_properties(device_index)
        return Target(props.total_memory / GIB, f"each {props.name}", True)
    import psutil

    share = f" to each of {local_processes} processes" if local_processes > 1 else ""
    gib = psutil.virtual_memory().available / GIB / max(1, local_processes)
    return Target(gib, f"the RAM available{share} (no CUDA device)", False)


def _lora_overrides(cfg: Config) -> tuple[Config, str]:
    """`cfg` as a LoRA run of rank SUGGESTED_LORA_RANK, and the overrides that say so (learning rates of parts that
    no longer train are unset, as the config's validation requires)."""
    train, unset = cfg.train, []
    for part in ("vision", "merger"):
        if getattr(train, f"lr_{part}") is not None:
            train = dataclasses.replace(train, **{f"lr_{part}": None})
            unset.append(f"train.lr_{part}=null")
    model = dataclasses.replace(cfg.model, freeze_vision=False, freeze_merger=False, freeze_llm=False)
    lora_cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=SUGGESTED_LORA_RANK), train=train, model=model)
    return lora_cfg, " ".join([f"lora.rank={SUGGESTED_LORA_RANK}", *unset])


def suggestions(
    cfg: Config, num_processes: int, sharding: Sharding, target: Target, model: nn.Module
) -> list[Suggestion]:
    """Single changes that bring the estimate under `target` (each alone, cheapest first): checkpointing more of
    what is not all checkpointed (the counts `auto` would choose), LoRA for a full fine-tune, the largest smaller
    pack, FSDP2 over the fewest GPUs (CUDA)."""

    def estimate(changed: Config, processes: int = num_processes, shard: Sharding = sharding) -> MemoryEstimate:
        return estimate_memory(changed, processes, shard, target.on_cuda, model=model)

    found = []
    depths = dict(zip(activation_checkpointing.PARTS, map(len, stack_blocks(model)), strict=True))
    counts = dict(zip(activation_checkpointing.PARTS, checkpointed_blocks(cfg, model), strict=True))
    short = {part: "auto" for part, count in counts.items() if count < depths[part]}
    if short:
        choice = activation_checkpointing.choose(
            activation_checkpointing.with_counts(cfg, short),
            num_processes,
            sharding,
            target.on_cuda,
            target.capacity_gib,
            model,
        )
        change = " ".join(
            f"model.gradient_checkpointing_{part}={str(choice.setting(part)).lower()}"
            for part in short
            if choice.setting(part) != getattr(cfg.model, f"gradient_checkpointing_{part}")
        )
        found.append(Suggestion(change, choice.estimate))
    if cfg.lora is None:
        lora_cfg, change = _lora_overrides(cfg)
        found.append(Suggestion(change, estimate(lora_cfg)))
    tokens = cfg.packing.max_tokens // 2
    while tokens >= SMALLEST_SUGGESTED_PACK:
        smaller = dataclasses.replace(cfg, packing=dataclasses.replace(cfg.packing, max_tokens=tokens))
        result = estimate(smaller)
        if result.fits(target.capacity_gib):
            found.append(Suggestion(f"packing.max_tokens={tokens}", result))
            break
        tokens //= 2
    if target.on_cuda:
        gpus = max(2, num_processes * 2 if sharding == "fsdp2" else 2)
        while gpus <= MAX_SUGGESTED_GPUS:
            result = estimate(cfg, gpus, "fsdp2")
            if result.fits(target.capacity_gib):
                found.append(Suggestion(f"FSDP2 over {gpus} GPUs ({FSDP2_LAUNCH.format(n=gpus)})", result))
                break
            gpus *= 2
    return [s for s in found if s.estimate.fits(target.capacity_gib)]


def refusal(estimate: MemoryEstimate, target: Target, fixes: list[Suggestion]) -> str:
    """The one line that says the run does not fit, and what does."""
    line = f"the memory estimate is {estimate.describe()}, more than the {target.capacity_gib:.1f} GiB of {target.name}"
    if fixes:
        options = "; ".join(f"{fix.change} (~{fix.estimate.total_gib:.0f} GiB)" for fix in fixes)
        line += f". Each of these fits: {options}"
    else:
        line += ". No single change of checkpointing, LoRA, pack size or FSDP2 fits: combine them"
    if not target.on_cuda:  # most likely a GPU recipe started on the wrong machine
        line += ". For GPUs: python -m scripts.estimate_memory --config <recipe> --gpus N [--gpu-memory-gib G]"
    return line + ". train.memory_check=warn starts it anyway (docs/memory.md)."


def sharding_of(accelerator) -> Sharding:
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return "fsdp2"
    return "ddp" if accelerator.num_processes > 1 else "none"


def check(cfg: Config, accelerator, target: Target | None = None) -> MemoryEstimate | None:
    """Estimate `cfg`'s memory for this launch and compare it with the device's (module docstring); the estimate,
    or None when `train.memory_check` is false. Raises MemoryFitError when it does not fit and the key is true."""
    if cfg.train.memory_check is False:
        return None
    on_cuda = accelerator.device.type == "cuda"
    if target is None:
        target = local_target(on_cuda, accelerator.device.index or 0, 1 if on_cuda else local_processes())
    sharding = sharding_of(accelerator)
    model = meta_model(cfg.model)
    # `auto` checkpointing as trainer/defaults.py will resolve it next (it logs the choice; a refusal stands alone)
    cfg, _ = activation_checkpointing.resolve(
        cfg, accelerator.num_processes, sharding, on_cuda, target.capacity_gib, target.name, model
    )
    estimate = estimate_memory(cfg, accelerator.num_processes, sharding, on_cuda, model=model)
    if estimate.fits(target.capacity_gib):
        log.info("memory estimate %s, within the %.1f GiB of %s", estimate.describe(), target.capacity_gib, target.name)
        return estimate
    line = refusal(estimate, target, suggestions(cfg, accelerator.num_processes, sharding, target, model))
    if cfg.train.memory_check == "warn":
        log.warning("train.memory_check=warn: %s", line)
        return estimate
    raise MemoryFitError(line if accelerator.is_main_process else "")  # the line once, from the main process


def gpu_targets(gpu_memory_gib: float | None = None) -> list[Target]:
    """`gpu_memory_gib`, else the GPU this machine sees, else REFERENCE_GPUS."""
    if gpu_memory_gib is not None:
        return [Target(gpu_memory_gib, "the GPU memory given", True)]
    import torch

    if torch.cuda.is_available():
        return [local_target(True, 0)]
    return list(REFERENCE_GPUS)


def fit_report(cfg: Config, gpus: int, sharding: Sharding, on_cuda: bool, held_against: list[Target]) -> list[str]:
    """The estimate's lines, then each target with whether it fits and, where not, the overrides that do. With
    `auto` checkpointing, what it resolves to on each target, and the estimate's lines with it."""
    model = meta_model(cfg.model)
    auto = activation_checkpointing.is_auto(cfg)
    lines = [] if auto else estimate_memory(cfg, gpus, sharding, on_cuda, model=model).lines()
    for target in held_against:
        resolved = cfg
        if auto:
            resolved, chosen = activation_checkpointing.resolve(
                cfg, gpus, sharding, on_cuda, target.capacity_gib, target.name, model
            )
            lines += [f"{target.name}, {target.capacity_gib:.1f} GiB:", *(f"  {line}" for line in chosen)]
            lines += estimate_memory(resolved, gpus, sharding, on_cuda, model=model).lines()
        held = estimate_memory(resolved, gpus, sharding, on_cuda, model=model)
        room = target.capacity_gib - held.total_gib
        verdict = f"fits ({room:.1f} GiB to spare)" if room >= 0 else f"does not fit ({-room:.1f} GiB short)"
        lines.append(f"{target.name}, {target.capacity_gib:.1f} GiB: {verdict}")
        if room < 0:
            lines += [
                f"  fits with {fix.change}: ~{fix.estimate.total_gib:.1f} GiB"
                for fix in suggestions(resolved, gpus, sharding, target, model)
            ]
    return lines
