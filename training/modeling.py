"""Build the model a recipe names: a checkpoint (`model.name_or_path`) or a random init from `model.config`."""

from __future__ import annotations

import os

import torch
import transformers
from transformers import AutoConfig, PretrainedConfig

from training.config import ModelConfig
from training.config_tree import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


def hf_config(model_cfg: ModelConfig) -> PretrainedConfig:
    """The Hugging Face config of the recipe's model (no weights are read)."""
    if model_cfg.config is not None:
        raw = dict(model_cfg.config)
        model_type = raw.pop("model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model.config.model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}.")
        return AutoConfig.for_model(model_type, **raw)
    config = _pretrained_config(model_cfg.name_or_path)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{model_cfg.name_or_path} is a {config.model_type!r} model; supported: {', '.join(SUPPORTED_MODEL_TYPES)}."
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


def build_model(model_cfg: ModelConfig, attn_implementation: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """Load or randomly initialise the recipe's model in `model.dtype` (seeded, so ranks and reruns agree)."""
    dtype = getattr(torch, model_cfg.dtype)
    config = hf_config(model_cfg)
    cls = model_class(config)
    if model_cfg.name_or_path is not None:
        return cls.from_pretrained(model_cfg.name_or_path, dtype=dtype, attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    return cls._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
