"""The ViT's patch embedding as one matrix product, its gradients accumulated in fp32.

Every family embeds patches with an nn.Conv3d whose kernel equals its stride, applied to inputs that are exactly one
kernel each (`pixel_values` rows of in_channels × temporal × patch × patch): each output is the dot product of one
row with one filter, i.e. `pixel_values @ weight.view(embed_dim, -1).T (+ bias)`. The convolution computes that
through cuDNN's implicit-GEMM kernel, which on GPUs is slower than the same product as one cuBLAS matmul
(docs/performance.md). Parameters, their shapes and the state dict are unchanged; the outputs equal the
convolution's up to the matmul's order of adding (one bf16 unit).

Gradients: `_PatchEmbedMatmul` returns the weight's and the bias's gradients in fp32, their products accumulated in
fp32 (cuBLAS's fp32 output on CUDA; the bf16 operands widened, which is exact, elsewhere). A pack calls the
embedding twice (its images, then its videos) and a step once more per micro-batch: with fp32 parameters (the
module's own in `train.master_weights=module`, and in `optimizer` mode too, which keeps the patch embedding fp32:
modeling/master_weights.py) those calls' gradients add in fp32, in the same order in both modes, so both modes get
the same gradient bit for bit. Autocast alone cannot give that: `weight.view(...)` is not a leaf, so autocast casts
it anew at each call and its two bf16 gradients meet in fp32 in module mode but in bf16 on a bf16 weight.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from modeling.parts import inner_model


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


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """What nn.Conv3d would multiply in: autocast's dtype when it is on, else the weight's."""
    device_type = weight.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype


def _weight_grad_fp32(grad_out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """grad_out.T @ rows, (E, K) in fp32 from operands in the compute dtype: cuBLAS accumulates and writes fp32 on
    CUDA; elsewhere the operands are widened to fp32 (exact) and multiplied in fp32."""
    if grad_out.dtype != torch.float32 and grad_out.device.type == "cuda":
        return torch.mm(grad_out.T, rows, out_dtype=torch.float32)
    return grad_out.T.float() @ rows.float()


class _PatchEmbedMatmul(torch.autograd.Function):
    """(P, K) rows @ (E, K) weight.T + bias in the compute dtype; backward: fp32 weight and bias gradients."""

    @staticmethod
    def forward(ctx, pixels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        dtype = _compute_dtype(weight)
        with torch.autocast(weight.device.type, enabled=False):
            rows = pixels.reshape(-1, weight[0].numel()).to(dtype)
            flat_weight = weight.reshape(weight.shape[0], -1).to(dtype)
            out = F.linear(rows, flat_weight, None if bias is None else bias.to(dtype))
        ctx.weight_shape, ctx.has_bias = weight.shape, bias is not None
        ctx.save_for_backward(rows, flat_weight if pixels.requires_grad else None)
        ctx.pixels_shape = pixels.shape
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        rows, flat_weight = ctx.saved_tensors
        grad_out = grad_out.to(rows.dtype)
        grad_pixels = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_pixels = (grad_out @ flat_weight).reshape(ctx.pixels_shape)
        if ctx.needs_input_grad[1]:
            grad_weight = _weight_grad_fp32(grad_out, rows).reshape(ctx.weight_shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.float().sum(0)
        return grad_pixels, grad_weight, grad_bias


def _matmul_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return _PatchEmbedMatmul.apply(hidden_states, self.proj.weight, self.proj.bias)


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
