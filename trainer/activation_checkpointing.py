"""`model.gradient_checkpointing_llm` and `_vision` = `auto` made concrete before the model is built: the fewest
decoder layers and ViT blocks to recompute so that the memory estimate (trainer/memory_estimate.py) fits the device
with AUTO_MARGIN to spare, for the launch in use (processes, FSDP2 or DDP, CUDA or the CPU's RAM).

A stack checkpoints its first N blocks (modeling/parts.py); the others keep their activations. Every count of an
`auto` stack is a candidate (a stack set to true, false or N keeps its count); among the pairs that fit, the one
whose recompute costs least wins: a recomputed block is one more forward of it, costed as its matmul weights times
the rows it multiplies (a decoder layer the pack's T tokens, a ViT block its P patches; routed experts at top-k of
their weights). When no count fits, each `auto` stack checkpoints every block and train.py's memory check refuses the
run in one line with the overrides that fit (trainer/memory_check.py).

Checkpointing changes no result: a recomputed block computes what it computed in the forward (the same ops on the
same inputs), so the losses and gradients of any count equal those of full checkpointing (tests/test_activation_
checkpointing.py, bit for bit in fp32 on the CPU).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from core.config import Config
from trainer.memory_estimate import (
    MemoryEstimate,
    Sharding,
    estimate_memory,
    meta_model,
    stack_blocks,
    tokens_per_pack,
    vision_patches_per_pack,
)

AUTO_MARGIN = 0.05
"""The share of the device's memory `auto` leaves free beyond the estimate's total (which already holds the
allocator's and the CUDA runtime's margins): the calibration (docs/memory.md) allows a measured peak up to 5% above
its estimate, and a pack of larger images than the average adds ViT activations."""
PARTS = ("llm", "vision")
STACK_NAMES = {"llm": "decoder layers", "vision": "ViT blocks"}


@dataclass(frozen=True)
class Choice:
    """The checkpointed (decoder layers, ViT blocks), the stacks' depths, the estimate with them and whether it fits
    within `allowed_gib`."""

    counts: tuple[int, int]
    depths: tuple[int, int]
    estimate: MemoryEstimate
    allowed_gib: float
    fits: bool

    def setting(self, part: str) -> bool | int:
        """The config value of `part`'s count: true for the whole stack, false for none, else the count."""
        index = PARTS.index(part)
        count, depth = self.counts[index], self.depths[index]
        return True if count == depth and depth else False if count == 0 else count

    def describe(self, part: str) -> str:
        index = PARTS.index(part)
        return f"{self.counts[index]} of {self.depths[index]} {STACK_NAMES[part]}"


def is_auto(cfg: Config) -> bool:
    return any(getattr(cfg.model, f"gradient_checkpointing_{part}") == "auto" for part in PARTS)


def allowed_gib(capacity_gib: float) -> float:
    """What `auto` lets the estimate's total reach on a device of `capacity_gib`."""
    return capacity_gib * (1 - AUTO_MARGIN)


def with_counts(cfg: Config, settings: dict[str, bool | int]) -> Config:
    """`cfg` with `settings` ({"llm": value, "vision": value}) as its checkpointing."""
    changes = {f"gradient_checkpointing_{part}": value for part, value in settings.items()}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes))


def _block_cost(block: nn.Module, moe_fraction: float) -> float:
    """The matmul weights one row passes through in `block`'s forward: its 2-D weights, and its routed experts' 3-D
    stacks at top-k of num_experts."""
    total = 0.0
    for name, param in block.named_parameters():
        if param.ndim == 2:
            total += param.numel()
        elif param.ndim == 3 and "experts" in name:
            total += param.numel() * moe_fraction
    return total


def recompute_costs(cfg: Config, model: nn.Module) -> tuple[list[float], list[float]]:
    """Per decoder layer and per ViT block, the cost of recomputing it (module docstring), in weight-rows."""
    text, vision = model.config.text_config, model.config.vision_config
    experts = getattr(text, "num_experts", None)
    moe_fraction = text.num_experts_per_tok / experts if experts else 1.0
    layers, blocks = stack_blocks(model)
    tokens = tokens_per_pack(cfg)
    patches = vision_patches_per_pack(cfg, tokens, vision)
    return [tokens * _block_cost(b, moe_fraction) for b in layers], [patches * _block_cost(b, 1.0) for b in blocks]


def choose(
    cfg: Config, num_processes: int, sharding: Sharding, on_cuda: bool, capacity_gib: float, model: nn.Module
) -> Choice:
    """The checkpointed counts `auto` resolves to for a device of `capacity_gib` (module docstring).

    The fitting pairs are found along their boundary: for each ViT count, from the most to none, the fewest decoder
    layers that fit, searched upwards from the previous count (fewer checkpointed ViT blocks never need fewer
    checkpointed layers), so at most depth(LLM) + depth(ViT) + 2 estimates."""
    layers, blocks = stack_blocks(model)
    depths = (len(layers), len(blocks))
    ranges = []
    for part, depth in zip(PARTS, depths, strict=True):
        value = getattr(cfg.model, f"gradient_checkpointing_{part}")
        ranges.append(list(range(depth + 1)) if value == "auto" else [None])
    limit = allowed_gib(capacity_gib)

    def estimate(llm: int | None, vision: int | None) -> MemoryEstimate:
        settings = {part: count for part, count in zip(PARTS, (llm, vision), strict=True) if count is not None}
        changed = with_counts(cfg, settings)
        return estimate_memory(changed, num_processes, sharding, on_cuda, model=model)

    llm_costs, vit_costs = recompute_costs(cfg, model)
    best: tuple[float, int | None, int | None, MemoryEstimate] | None = None
    index = 0
    for vision in reversed(ranges[1]):
        while index < len(ranges[0]):
            result = estimate(ranges[0][index], vision)
            if result.total_gib <= limit:
                break
            index += 1
        if index == len(ranges[0]):
            break
        llm = ranges[0][index]
        cost = sum(llm_costs[: llm or 0]) + sum(vit_costs[: vision or 0])
        if best is None or cost < best[0]:
            best = (cost, llm, vision, result)
    if best is None:
        llm, vision = ranges[0][-1], ranges[1][-1]
        result, fits = estimate(llm, vision), False
    else:
        _, llm, vision, result = best
        fits = True
    counts = []
    for part, count, depth in zip(PARTS, (llm, vision), depths, strict=True):
        if count is None:
            value = getattr(cfg.model, f"gradient_checkpointing_{part}")
            count = depth if value is True else 0 if value is False else value
        counts.append(count)
    return Choice((counts[0], counts[1]), depths, result, limit, fits)


def resolve(
    cfg: Config,
    num_processes: int,
    sharding: Sharding,
    on_cuda: bool,
    capacity_gib: float,
    device_name: str,
    model: nn.Module | None = None,
) -> tuple[Config, list[str]]:
    """`cfg` with each `auto` checkpointing setting concrete (module docstring), and one line per resolved key
    saying what it chose and why; a config without `auto` there comes back unchanged, with no line."""
    if not is_auto(cfg):
        return cfg, []
    model = model if model is not None else meta_model(cfg.model)
    choice = choose(cfg, num_processes, sharding, on_cuda, capacity_gib, model)
    if choice.fits:
        why = (
            f"the fewest that fit: estimate ~{choice.estimate.total_gib:.1f} GiB within the {choice.allowed_gib:.1f} "
            f"GiB auto allows of the {capacity_gib:.1f} GiB of {device_name}, {AUTO_MARGIN:.0%} kept free"
        )
    else:
        why = (
            f"all of them: estimate ~{choice.estimate.total_gib:.1f} GiB, over the {choice.allowed_gib:.1f} GiB auto "
            f"aims for on the {capacity_gib:.1f} GiB of {device_name}"
        )
        if not choice.estimate.fits(capacity_gib):
            why += " and over the device: the memory check names what fits"
    settings, lines = {}, []
    for part in PARTS:
        if getattr(cfg.model, f"gradient_checkpointing_{part}") != "auto":
            continue
        settings[part] = choice.setting(part)
        value = str(settings[part]).lower()
        lines.append(f"model.gradient_checkpointing_{part}=auto -> {value} ({choice.describe(part)} recompute; {why})")
    return with_counts(cfg, settings), lines
