"""The three trainable parts of a Qwen-VL model — vision tower, merger(s), LLM — for freezing, per-part learning
rates, FLOP counting and gradient checkpointing.

All six families share the layout `model.model.visual` (with `.merger`, and Qwen3-VL's `.deepstack_merger_list`),
`model.model.language_model` and `model.lm_head`; anything else is refused with the layout found.
"""

from __future__ import annotations

from torch import nn

from core.config_tree import ConfigError

MERGER_NAMES = ("merger", "deepstack_merger_list")


def inner_model(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "visual") or not hasattr(inner, "language_model"):
        raise ValueError(
            f"{type(model).__name__} lacks model.visual / model.language_model: not a supported Qwen-VL "
            "*ForConditionalGeneration model."
        )
    return inner


def vision_parts(model: nn.Module) -> list[nn.Module]:
    """The vision tower without its merger(s): patch embedding, position embedding, blocks."""
    visual = inner_model(model).visual
    return [module for name, module in visual.named_children() if name not in MERGER_NAMES]


def merger_parts(model: nn.Module) -> list[nn.Module]:
    """The patch merger(s) that project ViT features into the LLM's width."""
    visual = inner_model(model).visual
    return [module for name, module in visual.named_children() if name in MERGER_NAMES]


def llm_parts(model: nn.Module) -> list[nn.Module]:
    """The language model (embeddings, decoder layers, final norm) and the LM head."""
    return [inner_model(model).language_model, model.lm_head]


def part_modules(model: nn.Module) -> dict[str, list[nn.Module]]:
    return {"vision": vision_parts(model), "merger": merger_parts(model), "llm": llm_parts(model)}


def freeze(model: nn.Module, frozen: dict[str, bool]) -> None:
    """Turn off gradients of the parts whose flag is true (`{"vision": True, ...}`)."""
    for part, modules in part_modules(model).items():
        if frozen.get(part, False):
            for module in modules:
                module.requires_grad_(False)


def checkpointed_count(setting: bool | int, blocks: int, key: str) -> int:
    """How many of a stack's `blocks` a concrete `model.gradient_checkpointing_*` setting recomputes: true all,
    false none, N the first N; a ConfigError naming `key` for N above the stack's depth or an unresolved `auto`."""
    if isinstance(setting, bool):
        return blocks if setting else 0
    if not isinstance(setting, int):
        raise ConfigError(
            f"{key}={setting!r} is not resolved to a number of blocks (trainer/defaults.py resolves auto)."
        )
    if setting > blocks:
        raise ConfigError(f"{key}={setting}: the model has {blocks} such blocks; set at most {blocks} (or true).")
    return setting


def enable_gradient_checkpointing(model: nn.Module, llm: bool | int, vision: bool | int) -> tuple[int, int]:
    """Recompute activations in backward, separately for the LLM's decoder layers and the ViT's blocks: true every
    block of the stack, false none, N the first N (the blocks nearest the input, whose backward runs last: the
    recompute's working memory comes after the later blocks have freed their activations). Returns the
    (decoder layers, ViT blocks) checkpointed.

    Non-reentrant checkpointing: it needs no `enable_input_require_grads` hack when embeddings are frozen and works
    with FSDP2 and torch.compile (modeling/compile.py reads each block's own `gradient_checkpointing` flag).
    """
    inner = inner_model(model)
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    counts = []
    for key, setting, stack, blocks in (
        ("model.gradient_checkpointing_llm", llm, inner.language_model, inner.language_model.layers),
        ("model.gradient_checkpointing_vision", vision, inner.visual, inner.visual.blocks),
    ):
        count = checkpointed_count(setting, len(blocks), key)
        if count:
            stack.gradient_checkpointing_enable(**kwargs)
            for block in list(blocks)[count:]:
                block.gradient_checkpointing = False
        counts.append(count)
    return counts[0], counts[1]


def trainable_counts(model: nn.Module) -> dict[str, int]:
    """Trainable parameter count per part (for the start-up log); a tied lm_head/embedding matrix counts once."""
    seen: set[int] = set()
    counts = {}
    for part, modules in part_modules(model).items():
        params = {id(p): p for m in modules for p in m.parameters() if p.requires_grad and id(p) not in seen}
        seen |= params.keys()
        counts[part] = sum(p.numel() for p in params.values())
    return counts


def attention_head_dims(model: nn.Module) -> dict[str, int]:
    """The head dim of the language model's attention and of the ViT's, from the model's config."""
    config = model.config
    text, vision = config.text_config, config.vision_config
    text_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    vision_width = getattr(vision, "embed_dim", None) or vision.hidden_size  # Qwen2-VL names the ViT's width embed_dim
    return {"text": text_dim, "vision": vision_width // vision.num_heads}
