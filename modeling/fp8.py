"""FP8 matmuls for the language model's decoder layers: torchao's float8 training (`train.fp8`).

`convert_decoder_linears` swaps each `nn.Linear` inside the decoder layers (attention projections, MLP, Qwen3.5's
linear-attention projections) for torchao's `Float8Linear`: its forward and both backward matmuls run in float8
(e4m3) with scales computed on the fly, the weights and their masters keep their dtypes, and the optimizer sees
the same parameters. The ViT, the mergers, the embeddings and the lm_head stay in bf16 (small or precision-critical
matmuls, where float8's casts cost more than they save: docs/performance.md), and so do linears whose widths are not
multiples of 16 (float8 matmuls need them) and MoE experts (fused weights, not `nn.Linear`). Float8 pays only under
torch.compile, which fuses its casts and scales into the neighbouring kernels: train.py refuses it without compile.

A pack's token count is any number, but the weight gradient's float8 matmul contracts over the tokens and needs a
multiple of 16 (on the GPU: "Expected self.size(1) to be divisible by 16"). Each converted linear therefore pads its
input rows with zeros to the next multiple of 16 and drops the extra output rows: zero rows change no scale (an
amax) and add nothing to the weight gradient, so the result equals the unpadded float8 linear's.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from modeling import parts

Recipe = Literal["tensorwise", "rowwise"]
FP8_MIN_CAPABILITY = (8, 9)  # float8 tensor-core matmuls: Ada, Hopper and newer


def fp8_unavailable(device: torch.device) -> str | None:
    """Why float8 training cannot run on `device`, or None when it can."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        return f"compute capability {major}.{minor} has no float8 matmuls (8.9 or newer)"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "torchao is not installed (pip install -r requirements-fp8.txt)"
    return None


def _float8_ready(module: nn.Module, fqn: str) -> bool:
    """A plain linear with float8-compatible widths that is no LoRA adapter (their rank-wide matmuls stay bf16)."""
    shapes_fit = module.in_features % 16 == 0 and module.out_features % 16 == 0 if isinstance(module, nn.Linear) else 0
    return bool(shapes_fit) and "lora_" not in fqn


FLOAT8_ROWS = 16  # the token count the weight gradient's float8 matmul contracts over must be a multiple of this


def pad_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x (..., K) as (rows', K) with rows' the next multiple of FLOAT8_ROWS (zero rows appended), and its row count."""
    rows = x.shape[:-1].numel()
    flat = x.reshape(rows, x.shape[-1])
    return F.pad(flat, (0, 0, 0, (-rows) % FLOAT8_ROWS)), rows


@functools.cache
def row_padded(linear_class: type[nn.Linear]) -> type[nn.Linear]:
    """A subclass of `linear_class` whose forward pads its input rows to a multiple of FLOAT8_ROWS and drops the
    extra output rows (module docstring); one class per base, made on first use."""

    class RowPadded(linear_class):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            padded, rows = pad_rows(x)
            return super().forward(padded)[:rows].reshape(*x.shape[:-1], -1)

    RowPadded.__name__ = RowPadded.__qualname__ = f"RowPadded{linear_class.__name__}"
    return RowPadded


def convert_decoder_linears(model: nn.Module, recipe: Recipe = "tensorwise") -> int:
    """Swap the decoder layers' eligible `nn.Linear`s for row-padded torchao `Float8Linear`s in place (names and
    parameters unchanged, so checkpoints and the optimizer see the same model); returns how many."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig.from_recipe_name(recipe)
    layers = parts.inner_model(model).language_model.layers
    for layer in layers:
        convert_to_float8_training(layer, module_filter_fn=_float8_ready, config=config)
    converted = [m for m in layers.modules() if type(m) is Float8Linear]
    for module in converted:
        module.__class__ = row_padded(Float8Linear)
    return len(converted)
