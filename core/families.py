"""The model families this repo trains: every per-family fact, declared once, and how a recipe names its model.

Read by the rope patch (rotary classes, mRoPE lane layout), the tiny and image-only processors (processor class),
the FLOP model (ViT width key, windowed ViT), scripts/compare_throughput.py (which families Liger-Kernel can rope)
and the model builder (which model types a recipe may name). Adding a family means adding one `Family` here.
"""

from __future__ import annotations

import dataclasses
import os

import transformers
from transformers import AutoConfig, PretrainedConfig

from core.config_tree import ConfigError


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str  # transformers' model_type, also the name of its modeling module
    text_rotary: str  # class of the LLM's rotary module (the fused rope patch replaces its forward)
    vision_rotary: str  # class of the ViT's rotary module
    interleaved: bool  # mRoPE lane layout: Qwen3-VL / Qwen3.5 interleave t/h/w lanes, Qwen2/2.5-VL chunk them
    processor: str  # the image-only processor class in data/image_only_processor.py
    window_vision_model: str | None = None  # vision tower with window attention (reorders rotary tables per window)
    vit_width_key: str = "hidden_size"  # vision_config key of the ViT's attention width
    liger_rope: bool = False  # Liger-Kernel ships a rope for this family (scripts/compare_throughput.py)

    @property
    def modeling_module(self) -> str:
        return f"transformers.models.{self.model_type}.modeling_{self.model_type}"


FAMILIES = {
    f.model_type: f
    for f in (
        Family(
            "qwen2_vl",
            "Qwen2VLRotaryEmbedding",
            "Qwen2VLVisionRotaryEmbedding",
            interleaved=False,
            processor="Qwen2VLImageOnlyProcessor",
            vit_width_key="embed_dim",
            liger_rope=True,
        ),
        Family(
            "qwen2_5_vl",
            "Qwen2_5_VLRotaryEmbedding",
            "Qwen2_5_VLVisionRotaryEmbedding",
            interleaved=False,
            processor="Qwen2_5_VLImageOnlyProcessor",
            window_vision_model="Qwen2_5_VisionTransformerPretrainedModel",
            liger_rope=True,
        ),
        Family(
            "qwen3_vl",
            "Qwen3VLTextRotaryEmbedding",
            "Qwen3VLVisionRotaryEmbedding",
            interleaved=True,
            processor="Qwen3VLImageOnlyProcessor",
        ),
        Family(
            "qwen3_vl_moe",
            "Qwen3VLMoeTextRotaryEmbedding",
            "Qwen3VLMoeVisionRotaryEmbedding",
            interleaved=True,
            processor="Qwen3VLImageOnlyProcessor",
        ),
        Family(
            "qwen3_5",
            "Qwen3_5TextRotaryEmbedding",
            "Qwen3_5VisionRotaryEmbedding",
            interleaved=True,
            processor="Qwen3VLImageOnlyProcessor",
        ),
        Family(
            "qwen3_5_moe",
            "Qwen3_5MoeTextRotaryEmbedding",
            "Qwen3_5MoeVisionRotaryEmbedding",
            interleaved=True,
            processor="Qwen3VLImageOnlyProcessor",
        ),
    )
}
MODEL_TYPES = tuple(FAMILIES)


def hf_config(model_cfg) -> PretrainedConfig:
    """The Hugging Face config of the recipe's model (no weights are read). `model_cfg`: the recipe's `model`
    section (its `config` dict for a random init, else its `name_or_path` checkpoint)."""
    if model_cfg.config is not None:
        raw = dict(model_cfg.config)
        model_type = raw.pop("model_type", None)
        if model_type not in FAMILIES:
            raise ValueError(f"model.config.model_type must be one of {MODEL_TYPES}, got {model_type!r}.")
        return AutoConfig.for_model(model_type, **raw)
    config = _pretrained_config(model_cfg.name_or_path)
    if config.model_type not in FAMILIES:
        raise ValueError(
            f"{model_cfg.name_or_path} is a {config.model_type!r} model; supported: {', '.join(MODEL_TYPES)}."
        )
    return config


def _pretrained_config(source: str) -> PretrainedConfig:
    """AutoConfig of a checkpoint directory or Hub id; ConfigError naming model.name_or_path when there is none (a
    path that can only be local fails at once, without asking the Hub)."""
    local = source.startswith(("/", "./", "../", "~")) or os.path.isabs(source)
    if local and not os.path.isdir(os.path.expanduser(source)):
        raise ConfigError(f"model.name_or_path={source} is not a directory (a Hub id is 'owner/name').")
    try:
        return AutoConfig.from_pretrained(os.path.expanduser(source))
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"model.name_or_path={source}: no model config there ({reason})") from None


def model_class(config: PretrainedConfig) -> type:
    """The *ForConditionalGeneration class of a config (e.g. Qwen2_5_VLForConditionalGeneration)."""
    return getattr(transformers, config.architectures[0]) if config.architectures else _class_for_type(config)


def _class_for_type(config: PretrainedConfig) -> type:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[config.model_type])
