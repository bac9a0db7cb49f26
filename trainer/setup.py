"""Everything a training run builds before its first step, shared by train.py and scripts/profile_step.py.

Two calls, so the caller can configure logging between them (on the main process only, which takes the
Accelerator to know) before the data pipeline logs its statistics:

    accelerator = build_accelerator(cfg, log_with=tracking.log_with(cfg))
    setup = build_training(cfg, accelerator)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed

from core import distributed
from core.config import Config
from data.pipeline import StepLoader, build_data, load_processor
from modeling import attention_engines, context_parallel, fp8, lora, master_weights, parts, vision_plan
from modeling.build import build_model
from modeling.compile import compile_blocks
from modeling.packed import PACK_KWARG, enable_packed_forward
from modeling.patch_embed import use_matmul_patch_embed
from mrope_kernels.ops import runs_triton
from mrope_kernels.patch import apply_rope_choice
from trainer import defaults, metrics, optim, step

log = logging.getLogger(__name__)


@dataclass
class TrainingSetup:
    """The prepared training objects (module, optimizer and scheduler already through `accelerator.prepare`)."""

    module: torch.nn.Module  # loop.TrainModule around the HF model, wrapped for DDP/FSDP2
    optimizer: torch.optim.Optimizer
    grad_params: list[torch.nn.Parameter]  # the tensors the optimizer steps (masters or fp32 parameters): clipped
    scheduler: torch.optim.lr_scheduler.LRScheduler
    processor: Any  # the recipe's HF processor, shipped with the export
    train_loader: StepLoader
    eval_loader: StepLoader
    flop_profile: metrics.FlopProfile
    fused_rope: bool  # the Triton rope kernels run (patched in, on CUDA or under the Triton interpreter)
    masters: master_weights.MasterWeights | None  # train.master_weights=optimizer: the fp32 masters, else None


def build_accelerator(cfg: Config, log_with: list[str] | None = None) -> Accelerator:
    """The run's Accelerator; raises when the launcher started processes that it did not join.

    gradient_accumulation_steps stays 1: step.accumulate_gradients normalises by the global label count itself
    (accelerate would divide once more). The scheduler steps once per optimizer step, not once per process.
    """
    accelerator = Accelerator(
        mixed_precision=step.mixed_precision(cfg.model.dtype),
        log_with=log_with,
        step_scheduler_with_optimizer=False,
        **distributed.accelerator_kwargs(cfg.model.dtype),
    )
    distributed.check_world_size(accelerator.num_processes)
    return accelerator


def vision_alignment(accelerator: Accelerator) -> step.VisionAlignment:
    """The vision calls the run's ranks must share: FSDP2's per-call all-gathers pair up by kind; one process and
    DDP need only one call per pack (every vision parameter gets a gradient)."""
    return "step_kinds" if accelerator.distributed_type == DistributedType.FSDP else "any_call"


def build_training(cfg: Config, accelerator: Accelerator) -> TrainingSetup:
    """Seed, model, data, optimizer and schedule for `cfg`, in the order that makes a run reproducible; its `auto`
    settings are resolved for this launch first (trainer/defaults.py).

    The model is built in fp32 and gets the recipe's rope kernels, the packed forward, part freezing (or, with `lora`,
    adapters on a frozen base held in `model.dtype`: modeling/lora.py) and gradient checkpointing before the
    optimizer sees its parameters. Its fp32 weights are the masters (autocast computes in
    `model.dtype`), or with `train.master_weights=optimizer` its matmul weights are cast to `model.dtype` and the
    optimizer steps fp32 copies of them beside its other, fp32 parameters (modeling/master_weights.py). With
    `train.compile` its blocks are then compiled in place (modeling/compile.py), before accelerate wraps them. With
    `parallel.context` = CP > 1, the loaders deal packs by data-parallel rank (rank // CP) and shard each pack over
    the CP ranks of a context group (modeling/context_parallel.py).
    """
    cfg = defaults.resolve(cfg, accelerator)
    keep_masters_in_optimizer = master_weights.enabled(cfg, accelerator)
    cp = context_parallel.layout(accelerator.process_index, accelerator.num_processes, cfg.parallel.context)
    set_seed(cfg.train.seed)
    model = build_model(dataclasses.replace(cfg.model, dtype="float32"), seed=cfg.train.seed)
    rope = apply_rope_choice(model, cfg.kernels.mrope)
    if cfg.kernels.patch_embed == "matmul":
        use_matmul_patch_embed(model)
    fused_rope = rope is not None and runs_triton(accelerator.device)
    if rope is not None and not fused_rope:
        log.warning(
            "kernels.mrope=%s: the rope ops are patched in, but on %s without TRITON_INTERPRET=1 they run the "
            "plain-PyTorch reference, not the Triton kernels",
            cfg.kernels.mrope,
            accelerator.device.type,
        )
    enable_packed_forward(
        model, cfg.kernels.gated_delta, getattr(torch, cfg.model.dtype), attention_engine=cfg.kernels.attention
    )
    if accelerator.device.type == "cuda":
        head_dims = parts.attention_head_dims(model)
        # context parallelism's text attention (a query chunk against its key prefix) runs on fa2 alone
        text_engine = "fa2" if cp.context_size > 1 else cfg.kernels.attention
        log.info(
            "attention: %s; %s",
            attention_engines.describe(text_engine, {"text": head_dims["text"]}),
            attention_engines.describe(cfg.kernels.attention, {"vision": head_dims["vision"]}),
        )
    if cp.context_size > 1:
        group = context_parallel.new_context_group(accelerator.num_processes, cp.context_size)
        context_parallel.enable_context_parallel(model, group, PACK_KWARG)
        log.info(
            "context parallel: %d ranks per pack, %d data-parallel ranks (this rank: context %d, data %d)",
            cp.context_size,
            cp.data_size,
            cp.context_rank,
            cp.data_rank,
        )
    if cfg.lora is not None:
        lora.apply_lora(model, cfg.lora, getattr(torch, cfg.model.dtype))
    else:
        parts.freeze(
            model, {"vision": cfg.model.freeze_vision, "merger": cfg.model.freeze_merger, "llm": cfg.model.freeze_llm}
        )
    checkpointed = parts.enable_gradient_checkpointing(
        model, llm=cfg.model.gradient_checkpointing_llm, vision=cfg.model.gradient_checkpointing_vision
    )
    layers, blocks = len(model.model.language_model.layers), len(model.model.visual.blocks)
    log.info(
        "activation checkpointing: %d of %d decoder layers, %d of %d ViT blocks recompute in backward",
        checkpointed[0],
        layers,
        checkpointed[1],
        blocks,
    )
    if cfg.train.fp8:
        log.info("train.fp8: %d decoder linears on float8 (torchao, tensorwise)", fp8.convert_decoder_linears(model))
    if cfg.train.compile:
        compile_blocks(model)
    log.info(
        "rope: %s; trainable parameters per part: %s",
        "fused (Triton)" if fused_rope else "reference (fused ops, PyTorch math)" if rope else "unfused",
        parts.trainable_counts(model),
    )

    processor = load_processor(cfg.model, cfg.data)
    cp_shard = None
    if cp.context_size > 1:
        pad = processor.tokenizer.pad_token_id
        cp_shard = functools.partial(
            context_parallel.shard_pack,
            context_rank=cp.context_rank,
            context_size=cp.context_size,
            pad_token_id=pad if pad is not None else 0,
            spatial_merge_size=model.config.vision_config.spatial_merge_size,
        )
    train_loader, eval_loader, _ = build_data(
        cfg.data,
        cfg.packing,
        processor,
        model.config,
        cp.data_rank,
        cp.data_size,
        cfg.train.grad_accum_steps,
        shard=cp_shard,
        # the loader workers plan the vision tower's grids (a context-parallel pack's vision runs elsewhere)
        plan=vision_plan.VisionPlanner(model.model.visual).add_host_plans if cp_shard is None else None,
    )

    flop_profile = metrics.FlopProfile.from_model(model)
    module = step.TrainModule(model, vision_alignment(accelerator))
    groups = optim.param_groups(model, cfg.train)
    masters = None
    if keep_masters_in_optimizer:
        masters = master_weights.MasterWeights(model, getattr(torch, cfg.model.dtype), accelerator.device)
        groups = masters.param_groups(groups)
    optimizer = optim.build_optimizer(groups, cfg.train, accelerator.device.type)
    if masters is not None:
        masters.follow(optimizer)
    scheduler = optim.build_scheduler(optimizer, cfg.train)
    module, optimizer, scheduler = accelerator.prepare(module, optimizer, scheduler)
    if masters is not None:
        accelerator.register_for_checkpointing(masters)
        grad_params = masters.optimizer_params
    else:
        grad_params = [p for p in module.parameters() if p.requires_grad]
    return TrainingSetup(
        module=module,
        optimizer=optimizer,
        grad_params=grad_params,
        scheduler=scheduler,
        processor=processor,
        train_loader=train_loader,
        eval_loader=eval_loader,
        flop_profile=flop_profile,
        fused_rope=fused_rope,
        masters=masters,
    )
