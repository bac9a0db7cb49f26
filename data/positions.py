"""Per-sample mRoPE position ids from the model's own `get_rope_index`, without building the model or its weights.

`get_rope_index` (and the `get_vision_position_ids` it calls) read nothing from the model but `self.config`, so an
instance of the family's inner model class with only `nn.Module` state and the config runs the real method.
tests/test_data_pipeline.py checks the result equals a real tiny model's `model.model.get_rope_index`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
from transformers import PretrainedConfig

from core.families import model_class

RopeIndexFn = Callable[..., torch.Tensor]


def inner_model_class(model_config: PretrainedConfig) -> type:
    """The family's base model class that owns `get_rope_index` (e.g. Qwen2_5_VLModel)."""
    outer = model_class(model_config)
    module = sys.modules[outer.__module__]
    inner = getattr(module, outer.__name__.replace("ForConditionalGeneration", "Model"), None)
    if inner is None or not hasattr(inner, "get_rope_index"):
        raise TypeError(f"{outer.__name__}: no base model class with get_rope_index in {module.__name__}.")
    return inner


def takes_second_per_grid_ts(model: torch.nn.Module) -> bool:
    """Whether the family's get_rope_index spaces video patches by seconds (Qwen2.5-VL's second_per_grid_ts)."""
    return "second_per_grid_ts" in inspect.signature(model.get_rope_index).parameters


def rope_index_fn(model_config: PretrainedConfig) -> RopeIndexFn:
    """A function `(input_ids (1, L) long, mm_token_type_ids (1, L) int, image_grid_thw (n, 3) long | None,
    video_grid_thw (m, 3) long | None = None, second_per_grid_ts (m,) float | None = None) -> (3, L) long` running
    the family's `get_rope_index` on one sample (second_per_grid_ts is passed only to families that take it)."""
    cls = inner_model_class(model_config)
    stand_in = cls.__new__(cls)
    torch.nn.Module.__init__(stand_in)
    stand_in.config = model_config
    timed = takes_second_per_grid_ts(stand_in)

    def positions(
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
    ):
        extra = {"second_per_grid_ts": second_per_grid_ts} if timed else {}
        position_ids, _ = stand_in.get_rope_index(
            input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, **extra
        )
        return position_ids[:, 0]

    return positions
