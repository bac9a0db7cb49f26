"""The recipe's `auto` settings made concrete for this launch, so a recipe as shipped runs the fast path on a GPU
and stays light on a CPU:

    train.compile         auto → true with CUDA (regional compile, modeling/compile.py), false on the CPU, where
                          inductor's compile of every block costs more than a CPU run's steps gain
    train.master_weights  auto → optimizer (bf16 compute weights, fp32 masters in AdamW: modeling/master_weights.py)
                          for one CUDA process computing in bfloat16; module elsewhere: under FSDP2, whose mixed
                          precision already computes on bf16 parameters with fp32 masters and an fp32 reduce
                          (core/distributed.py); under DDP, which would reduce bf16 gradients in bf16; on the CPU;
                          and in float32 or float16
    kernels.attention     auto → fa4 where flash-attn-4 imports and the GPU is Hopper or Blackwell, else fa2, with the
                          reason (modeling/attention_engines.py); fa4 asked for where it cannot run is an error
    train.fp8             auto → false, with the reason: on the Qwen3-VL-2B recipe float8 decoder linears ran slower
                          than bf16 with a higher loss (docs/performance.md#fp8-linears); true needs a GPU that runs
                          float8, compile and no FSDP2, and where it cannot run it is an error
    data.num_workers      null → with CUDA, min(8, CPU cores per local process - 1), at least 1; on the CPU 0 (batches
                          collate in the prefetch thread: the cores are busy with the step itself); the rule is
                          data/pipeline.py's `default_loader_workers`, which build_data also applies to a null
    model.gradient_checkpointing_llm / _vision
                          auto → the fewest decoder layers / ViT blocks to recompute (true: all, false: none, N: the
                          first N) so that the memory estimate fits this device (each GPU's memory, or the RAM of a
                          CPU-only host) with a margin: trainer/activation_checkpointing.py. Every rank takes the main
                          process's choice.

`resolve` returns the config with those values and logs each one it chose, e.g. `train.compile=auto -> true (CUDA)`,
`model.gradient_checkpointing_llm=auto -> 12 (12 of 28 decoder layers recompute; ...)`;
train.py resolves before it writes the run's config.yaml, so the run directory records what ran, and a resume on a
machine that resolves differently shows the difference (lifecycle/resume.py).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list

from core.config import Config, ConfigError, ModelConfig, TrainConfig
from data.pipeline import cpu_cores, default_loader_workers, local_processes
from modeling import attention_engines, fp8, master_weights
from trainer import activation_checkpointing, memory_check

log = logging.getLogger(__name__)


def resolve(cfg: Config, accelerator: Accelerator) -> Config:
    """`cfg` with train.compile, train.master_weights, train.fp8, kernels.attention, data.num_workers and the
    checkpointing concrete (module docstring); a config without `auto` / null there comes back unchanged and logs
    nothing."""
    on_cuda = accelerator.device.type == "cuda"
    model, chosen = _checkpointing(cfg, accelerator, on_cuda)
    train, data, kernels = cfg.train, cfg.data, cfg.kernels
    if train.compile == "auto":
        train = dataclasses.replace(train, compile=on_cuda)
        chosen.append(f"train.compile=auto -> {str(on_cuda).lower()} ({'CUDA' if on_cuda else 'no CUDA'})")
    if train.master_weights == "auto":
        mode, why = _master_weights(cfg, accelerator, on_cuda)
        train = dataclasses.replace(train, master_weights=mode)
        chosen.append(f"train.master_weights=auto -> {mode} ({why})")
    if train.fp8 is not False:
        enabled, why = _fp8(train, accelerator)
        if train.fp8 == "auto":
            chosen.append(f"train.fp8=auto -> {str(enabled).lower()} ({why})")
        train = dataclasses.replace(train, fp8=enabled)
    engine, why = attention_engines.resolve_engine(kernels.attention, accelerator.device)
    if kernels.attention == "auto":
        kernels = dataclasses.replace(kernels, attention=engine)
        chosen.append(f"kernels.attention=auto -> {engine} ({why})")
    if data.num_workers is None:
        cores, local = cpu_cores(), local_processes()
        data = dataclasses.replace(data, num_workers=default_loader_workers(on_cuda, cores, local))
        where = f"{cores} cores, {local} local process(es)" if on_cuda else "no CUDA: collated inline"
        chosen.append(f"data.num_workers=null -> {data.num_workers} ({where})")
    for line in chosen:
        log.info("%s", line)
    return dataclasses.replace(cfg, model=model, train=train, data=data, kernels=kernels) if chosen else cfg


def _checkpointing(cfg: Config, accelerator: Accelerator, on_cuda: bool) -> tuple[ModelConfig, list[str]]:
    """cfg.model with `auto` checkpointing resolved for this launch, and the lines that say so (the main process's
    choice on every rank: another rank's device or free RAM may differ)."""
    if not activation_checkpointing.is_auto(cfg):
        return cfg.model, []
    index = accelerator.device.index or 0
    target = memory_check.local_target(on_cuda, index, 1 if on_cuda else local_processes())
    sharding = memory_check.sharding_of(accelerator)
    resolved, lines = activation_checkpointing.resolve(
        cfg, accelerator.num_processes, sharding, on_cuda, target.capacity_gib, target.name
    )
    chosen = [resolved.model, lines]
    if accelerator.num_processes > 1 and torch.distributed.is_initialized():
        broadcast_object_list(chosen, from_process=0)
    return chosen[0], chosen[1]


def _fp8(train: TrainConfig, accelerator: Accelerator) -> tuple[bool, str]:
    """train.fp8 made concrete (train.compile already is), and why; raises ConfigError for fp8=true where it cannot
    run."""
    blocker = fp8.fp8_unavailable(accelerator.device)
    if blocker is None and not train.compile:
        blocker = "train.compile is false (float8 casts and scales run as separate kernels without it)"
    if blocker is None and accelerator.distributed_type == DistributedType.FSDP:
        blocker = "not verified under FSDP2"
    if train.fp8 is True:
        if blocker is not None:
            raise ConfigError(f"train.fp8=true cannot run here: {blocker}. Use train.fp8=auto or false.")
        return True, "requested"
    return False, blocker or "measured slower than bf16 on the recipes (docs/performance.md#fp8-linears)"


def _master_weights(cfg: Config, accelerator: Accelerator, on_cuda: bool) -> tuple[str, str]:
    """train.master_weights for auto, and why."""
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    return master_weights.auto_mode(cfg.model.dtype, fsdp, accelerator.num_processes, on_cuda)
