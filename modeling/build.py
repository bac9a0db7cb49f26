"""Build the model a recipe names: a checkpoint (`model.name_or_path`) or a random init from `model.config`."""

from __future__ import annotations

import torch

from core.config import ModelConfig
from core.families import hf_config, model_class


def build_model(model_cfg: ModelConfig, attn_implementation: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """Load or randomly initialise the recipe's model in `model.dtype` (seeded, so ranks and reruns agree)."""
    dtype = getattr(torch, model_cfg.dtype)
    config = hf_config(model_cfg)
    cls = model_class(config)
    if model_cfg.name_or_path is not None:
        return cls.from_pretrained(model_cfg.name_or_path, dtype=dtype, attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    return cls._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
