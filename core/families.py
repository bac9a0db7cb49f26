"""The model families this repo trains: every per-family fact, declared once, and how a recipe names its model.

Read by the rope patch (rotary classes, mRoPE lane layout), the tiny and image-only processors (processor class),
the FLOP model (ViT width key, windowed ViT), verification/throughput_compare.py (which families Liger-Kernel can rope)
and the model builder (which model types a recipe may name). Adding a family means adding one `Family` here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from core.config_tree import ConfigError, deep_merge
from core.special_tokens import TINY_CONFIG_TOKEN_IDS, TINY_TEXT_CONFIG_TOKEN_IDS

if TYPE_CHECKING:  # transformers is imported where a config is built: reading and validating a recipe needs none of it
    from transformers import PretrainedConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
BASE_KEY = "base"  # a model.config mapping's key naming the JSON file its other keys are merged over
# What makes two configs the same model: compared between a checkpoint and the recipe's model.config
ARCHITECTURE_FIELDS = {
    "": ("model_type", "tie_word_embeddings"),
    "text_config": (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "layer_types",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
    ),
    "vision_config": (
        "depth",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "out_hidden_size",
        "patch_size",
        "spatial_merge_size",
        "temporal_patch_size",
    ),
}


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str  # transformers' model_type, also the name of its modeling module
    text_rotary: str  # class of the LLM's rotary module (the fused rope patch replaces its forward)
    vision_rotary: str  # class of the ViT's rotary module
    interleaved: bool  # mRoPE lane layout: Qwen3-VL / Qwen3.5 interleave t/h/w lanes, Qwen2/2.5-VL chunk them
    processor: str  # the image-only processor class in data/image_only_processor.py
    window_vision_model: str | None = None  # vision tower with window attention (reorders rotary tables per window)
    vit_width_key: str = "hidden_size"  # vision_config key of the ViT's attention width
    liger_rope: bool = False  # Liger-Kernel ships a rope for this family (verification/throughput_compare.py)

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


def config_file(path: str) -> Path:
    """The JSON file a model.config path names: absolute, or relative to the working directory, else to the
    repository (recipes/models/*.json resolve from anywhere). ConfigError when there is none."""
    candidates = [Path(path).expanduser()] if Path(path).expanduser().is_absolute() else [Path(path), REPO_ROOT / path]
    found = next((candidate for candidate in candidates if candidate.is_file()), None)
    if found is None:
        raise ConfigError(f"model.config: no file {path} (a Hugging Face config.json, e.g. recipes/models/*.json).")
    return found


def _read_json(path: str) -> dict:
    try:
        value = json.loads(config_file(path).read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"model.config: {path} is not JSON ({error.msg}, line {error.lineno}).") from None
    if not isinstance(value, dict):
        raise ConfigError(f"model.config: {path} holds a {type(value).__name__}, not a config mapping.")
    return value


def recipe_model_config(config: dict | str) -> dict:
    """The Hugging Face config dict a recipe's `model.config` gives: a mapping as it is; a path, that JSON file's
    mapping; a mapping with `base: <path>`, that file's mapping with the mapping's other keys merged over it (nested
    mappings merge, other values replace: a benchmark's depth over the published config). ConfigError when a file
    is missing or not JSON, or the model_type is not one of MODEL_TYPES."""
    if isinstance(config, str):
        raw = _read_json(config)
    elif BASE_KEY in config:
        base = config[BASE_KEY]
        if not isinstance(base, str):
            raise ConfigError(f"model.config.{BASE_KEY} must be a path to a JSON config, got {base!r}.")
        raw = deep_merge(_read_json(base), {k: v for k, v in config.items() if k != BASE_KEY})
    elif "model_type" not in config:
        raise ConfigError(
            f"model.config has no model_type and no {BASE_KEY}: <file> (keys: {sorted(config)}). A dotted override "
            f"of a field replaces a model.config given as a path: write it as {{{BASE_KEY}: <file>}} to merge over it."
        )
    else:
        raw = dict(config)
    if raw.get("model_type") not in FAMILIES:
        raise ConfigError(f"model.config.model_type must be one of {MODEL_TYPES}, got {raw.get('model_type')!r}.")
    return raw


def with_tiny_token_ids(raw: dict) -> dict:
    """`raw` (a config dict) with the built-in tiny tokenizer's special-token ids (core/special_tokens.py) in its
    token-id fields, its vocabulary and everything else kept: what a random init trained with the tiny processor
    needs, since that processor's tokens carry those ids."""
    text = {**raw.get("text_config", {}), **TINY_TEXT_CONFIG_TOKEN_IDS}
    return {**raw, **TINY_CONFIG_TOKEN_IDS, "text_config": text}


def hf_config(model_cfg) -> PretrainedConfig:
    """The Hugging Face config of the recipe's model (no weights are read). `model_cfg`: the recipe's `model`
    section.

    With `name_or_path`, the checkpoint's own config; a `config` beside it must describe the same model
    (ARCHITECTURE_FIELDS; ConfigError naming the differences otherwise). Without, a random init from `config`
    (`recipe_model_config`); when no `processor` is named either, the data run through the built-in tiny
    processor, so the config takes its special-token ids (`with_tiny_token_ids`)."""
    if model_cfg.name_or_path is None:
        raw = recipe_model_config(model_cfg.config)
        if model_cfg.processor is None:
            raw = with_tiny_token_ids(raw)
        return _from_dict(raw)
    config = _pretrained_config(model_cfg.name_or_path)
    if config.model_type not in FAMILIES:
        raise ValueError(
            f"{model_cfg.name_or_path} is a {config.model_type!r} model; supported: {', '.join(MODEL_TYPES)}."
        )
    if model_cfg.config is not None:
        differences = architecture_differences(config, _from_dict(recipe_model_config(model_cfg.config)))
        if differences:
            raise ConfigError(
                f"model.name_or_path={model_cfg.name_or_path} is not the model model.config describes "
                f"({'; '.join(differences)}): use its own recipe, or add model.config=null to train it as it is."
            )
    return config


def _from_dict(raw: dict) -> PretrainedConfig:
    from transformers import AutoConfig

    raw = dict(raw)
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def architecture_differences(checkpoint: PretrainedConfig, recipe: PretrainedConfig) -> list[str]:
    """'<field>: <checkpoint's> in the checkpoint, <recipe's> in model.config' for every ARCHITECTURE_FIELDS field
    where the two configs differ."""
    differences = []
    for section, fields in ARCHITECTURE_FIELDS.items():
        ours, theirs = (getattr(c, section) if section else c for c in (checkpoint, recipe))
        for name in fields:
            a, b = getattr(ours, name, None), getattr(theirs, name, None)
            if a != b:
                differences.append(f"{section + '.' if section else ''}{name}: {a!r} in the checkpoint, {b!r} here")
    return differences


def _pretrained_config(source: str) -> PretrainedConfig:
    """AutoConfig of a checkpoint directory or Hub id; ConfigError naming model.name_or_path when there is none (a
    path that can only be local fails at once, without asking the Hub)."""
    local = source.startswith(("/", "./", "../", "~")) or os.path.isabs(source)
    if local and not os.path.isdir(os.path.expanduser(source)):
        raise ConfigError(f"model.name_or_path={source} is not a directory (a Hub id is 'owner/name').")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(os.path.expanduser(source))
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"model.name_or_path={source}: no model config there ({reason})") from None


def model_class(config: PretrainedConfig) -> type:
    """The *ForConditionalGeneration class of a config (e.g. Qwen2_5_VLForConditionalGeneration)."""
    import transformers

    return getattr(transformers, config.architectures[0]) if config.architectures else _class_for_type(config)


def _class_for_type(config: PretrainedConfig) -> type:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[config.model_type])
