"""Test setup: without CUDA, Triton kernels run under the interpreter (set before triton is imported); the shared
tiny-model fixture."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy
import dataclasses
from collections.abc import Callable, Sequence

import pytest

from training.config import load_config
from training.modeling import build_model


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _build_tiny_model(
    family: str,
    dtype: str = "float32",
    overrides: Sequence[str] = (),
    text_config: dict | None = None,
    vision_config: dict | None = None,
) -> torch.nn.Module:
    """The family's tiny recipe model (recipes/tiny-<family>.yaml), random-init with seed 0, sdpa attention.

    dtype: the model's dtype; overrides: dotted recipe overrides (e.g. "model.config.text_config.hidden_size=64");
    text_config / vision_config: fields of the model config's text / vision section replaced (whole values)."""
    model_cfg = load_config(f"recipes/tiny-{family}.yaml", list(overrides)).model
    config = copy.deepcopy(model_cfg.config)
    config["text_config"].update(text_config or {})
    config["vision_config"].update(vision_config or {})
    return build_model(dataclasses.replace(model_cfg, config=config, dtype=dtype), attn_implementation="sdpa", seed=0)


@pytest.fixture(scope="session")
def tiny_model() -> Callable[..., torch.nn.Module]:
    """`tiny_model(family, dtype="float32", overrides=(), text_config=None, vision_config=None)` builds a fresh tiny
    model of one of the six families (see `_build_tiny_model`)."""
    return _build_tiny_model
