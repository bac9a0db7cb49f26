"""AdamW over per-part parameter groups (learning rate per part, no decay on norms/biases) and the
linear-warmup + cosine schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from core.config import TrainConfig
from modeling import parts


def part_learning_rates(train_cfg: TrainConfig) -> dict[str, float]:
    """Peak learning rate of each part: `train.lr` for the LLM, `lr_vision` / `lr_merger` where set."""
    return {
        "vision": train_cfg.lr if train_cfg.lr_vision is None else train_cfg.lr_vision,
        "merger": train_cfg.lr if train_cfg.lr_merger is None else train_cfg.lr_merger,
        "llm": train_cfg.lr,
    }


def param_groups(model: nn.Module, train_cfg: TrainConfig) -> list[dict]:
    """One group per (part, decay) pair that has trainable parameters; matrices decay, vectors (norms, biases)
    don't. Each group carries a `name` for logging."""
    lrs = part_learning_rates(train_cfg)
    groups = []
    seen: set[int] = set()
    for part, modules in parts.part_modules(model).items():
        decay, no_decay = [], []
        for module in modules:
            for param in module.parameters():
                if not param.requires_grad or id(param) in seen:  # tied lm_head/embeddings appear twice
                    continue
                seen.add(id(param))
                (decay if param.ndim >= 2 else no_decay).append(param)
        for suffix, params, wd in (("", decay, train_cfg.weight_decay), ("_no_decay", no_decay, 0.0)):
            if params:
                groups.append({"name": part + suffix, "params": params, "lr": lrs[part], "weight_decay": wd})
    if not groups:
        raise ValueError("no trainable parameters: check model.freeze_* in the recipe.")
    return groups


def build_optimizer(groups: list[dict], train_cfg: TrainConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW over `groups` (`param_groups`, or their fp32 masters); the fused single-kernel implementation when
    training on CUDA (`device_type`)."""
    fused = True if device_type == "cuda" else None  # None: PyTorch's default (foreach) elsewhere
    return torch.optim.AdamW(groups, betas=tuple(train_cfg.adam_betas), fused=fused)


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Factor on the peak LR after `step` optimizer steps: linear warmup from 1/warmup to 1, then a cosine from 1
    down to `min_lr_ratio` at `max_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(max_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg: TrainConfig) -> LambdaLR:
    return LambdaLR(
        optimizer,
        lambda step: lr_multiplier(step, train_cfg.warmup_steps, train_cfg.max_steps, train_cfg.min_lr_ratio),
    )


HYPERPARAMETERS = ("initial_lr", "weight_decay", "betas")


def config_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's hyperparameters as the config set them (read before a checkpoint is loaded)."""
    return [{key: group[key] for key in HYPERPARAMETERS} for group in optimizer.param_groups]


def reapply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler, hyperparameters: list[dict]) -> None:
    """Put the config's hyperparameters back after a checkpoint load, which restores the saved run's (its lr,
    betas, weight decay): the run uses, and logs, what its config says. The current lr is recomputed from the
    schedule at the restored step, which for an unchanged config reproduces the saved value bit for bit."""
    lambda_lr = getattr(scheduler, "scheduler", scheduler)  # accelerate wraps the LambdaLR
    for group, values, multiplier in zip(optimizer.param_groups, hyperparameters, lambda_lr.lr_lambdas, strict=True):
        group.update(values)
        group["lr"] = values["initial_lr"] * multiplier(lambda_lr.last_epoch)
    lambda_lr.base_lrs = [values["initial_lr"] for values in hyperparameters]
