"""Test setup: without CUDA, Triton kernels run under the interpreter (set before triton is imported); the shared
tiny-model and synthetic-sample fixtures."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy
import dataclasses
from collections.abc import Callable, Sequence

import pytest

from core.config import load_config
from data.collate import VIDEO_SECONDS, VISION_INPUTS
from modeling.build import build_model
from verification.packing_check import synthetic_sample

# The tensors of a synthetic sample moved to the test's device (pixels also to the model's dtype).
SAMPLE_TENSORS = ("input_ids", "shift_labels", "mm_token_type_ids", *VISION_INPUTS, VIDEO_SECONDS)


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


def _build_tiny_samples(model: torch.nn.Module, specs: Sequence, seed: int = 0, device: str = "cpu") -> list:
    """Synthetic samples of `specs` (verification.packing_check.SampleSpec) for `model`, drawn with `seed`, on
    `device`; pixels in the model's dtype, seconds per temporal patch kept in float64 (positions derive from them)."""
    generator = torch.Generator().manual_seed(seed)
    samples = [synthetic_sample(model.config, spec, generator) for spec in specs]
    for sample in samples:
        for name in SAMPLE_TENSORS:
            value = getattr(sample, name)
            if value is not None:
                setattr(sample, name, value.to(device, model.dtype if name.startswith("pixel_values") else None))
    return samples


@pytest.fixture(scope="session")
def tiny_samples() -> Callable[..., list]:
    """`tiny_samples(model, specs, seed=0, device="cpu")` draws synthetic samples for a tiny model (see
    `_build_tiny_samples`)."""
    return _build_tiny_samples


@pytest.fixture
def step_plans(monkeypatch) -> list[torch.Tensor]:
    """The grids planned on the training step's host (modeling/vision_plan.py's `plan_kwargs`), recorded as they
    are planned, in order."""
    from modeling import vision_plan

    planned: list[torch.Tensor] = []
    plan_kwargs = vision_plan.plan_kwargs

    def recording(visual, grid, device):
        planned.append(grid)
        return plan_kwargs(visual, grid, device)

    monkeypatch.setattr(vision_plan, "plan_kwargs", recording)
    return planned
