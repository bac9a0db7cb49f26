"""The ViT's patch embedding as one matrix product.

Every family embeds patches with an nn.Conv3d whose kernel equals its stride, applied to inputs that are exactly one
kernel each (`pixel_values` rows of in_channels × temporal × patch × patch): each output is the dot product of one
row with one filter, i.e. `pixel_values @ weight.view(embed_dim, -1).T (+ bias)`. The convolution computes that
through cuDNN's implicit-GEMM kernel, which on GPUs is slower than the same product as one cuBLAS matmul
(docs/performance.md). Parameters, their shapes and the state dict are unchanged; the outputs equal the
convolution's up to the matmul's order of adding (one bf16 unit).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from training.parts import inner_model


def is_patchwise_conv(conv: nn.Module) -> bool:
    """Whether `conv` is a Conv3d that sees each input row as exactly one kernel (kernel == stride, no padding,
    dilation or groups): the convolution is then a matrix product."""
    return (
        isinstance(conv, nn.Conv3d)
        and tuple(conv.kernel_size) == tuple(conv.stride)
        and tuple(conv.padding) == (0, 0, 0)
        and tuple(conv.dilation) == (1, 1, 1)
        and conv.groups == 1
        and conv.padding_mode == "zeros"
    )


def _matmul_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = self.proj.weight
    rows = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
    return F.linear(rows, weight.view(weight.shape[0], -1), self.proj.bias)


def use_matmul_patch_embed(model: nn.Module) -> None:
    """Make `model.model.visual.patch_embed` compute its convolution as a matrix product (module docstring).
    Raises ValueError if the model has no such patch embedding or it is already switched."""
    embed = getattr(inner_model(model).visual, "patch_embed", None)
    if embed is None or not is_patchwise_conv(getattr(embed, "proj", None)):
        raise ValueError(
            f"{type(model).__name__}'s visual.patch_embed is not a Conv3d with kernel == stride: "
            "set kernels.patch_embed=conv."
        )
    if "forward" in embed.__dict__:
        raise ValueError("visual.patch_embed already has a forward of its own.")
    embed.forward = types.MethodType(_matmul_forward, embed)
