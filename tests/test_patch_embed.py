"""The ViT's patch embedding as a matrix product (training/patch_embed.py) against transformers' Conv3d."""

import copy

import pytest
import torch
from torch import nn

from core.families import FAMILIES
from training.parts import inner_model
from training.patch_embed import is_patchwise_conv, use_matmul_patch_embed


def _pixel_rows(embed: nn.Module, rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, embed.proj.weight[0].numel(), generator=generator) * 3


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_matmul_patch_embed_equals_the_convolution_forward_and_backward(tiny_model, family):
    """Every family's patch embedding (with and without a bias), fp32 on the CPU: outputs and the weight's and bias's
    gradients equal the Conv3d's to fp32 rounding; parameters and the state dict are untouched."""
    model = tiny_model(family)
    reference = copy.deepcopy(model)
    use_matmul_patch_embed(model)
    embed, conv_embed = inner_model(model).visual.patch_embed, inner_model(reference).visual.patch_embed
    assert model.state_dict().keys() == reference.state_dict().keys()
    pixels = _pixel_rows(embed, rows=37)  # odd: no row count is assumed
    out, conv_out = embed(pixels), conv_embed(pixels)
    assert out.shape == conv_out.shape == (37, embed.proj.out_channels)
    torch.testing.assert_close(out, conv_out, rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(out)
    params = [p for p in embed.parameters()]
    grads = torch.autograd.grad(out, params, upstream)
    conv_grads = torch.autograd.grad(conv_out, list(conv_embed.parameters()), upstream)
    assert len(grads) == (2 if embed.proj.bias is not None else 1)
    for grad, conv_grad in zip(grads, conv_grads, strict=True):
        torch.testing.assert_close(grad, conv_grad, rtol=1e-5, atol=1e-4)
    assert "forward" not in conv_embed.__dict__ and "forward" in embed.__dict__


def test_matmul_patch_embed_under_bf16_autocast_is_within_one_bf16_unit(tiny_model):
    """Under bf16 autocast (how training runs it) the two add in different orders: within one bf16 unit."""
    model = tiny_model("qwen2_5_vl")
    reference = copy.deepcopy(model)
    use_matmul_patch_embed(model)
    pixels = _pixel_rows(inner_model(model).visual.patch_embed, rows=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = inner_model(model).visual.patch_embed(pixels)
        conv_out = inner_model(reference).visual.patch_embed(pixels)
    assert out.dtype == conv_out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), conv_out.float(), rtol=2**-7, atol=2**-7)


def test_only_kernel_equals_stride_convolutions_are_matrix_products(tiny_model):
    assert is_patchwise_conv(nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4)))
    assert not is_patchwise_conv(nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(1, 4, 4)))
    assert not is_patchwise_conv(nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4), padding=1))
    assert not is_patchwise_conv(nn.Conv3d(4, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4), groups=2))
    assert not is_patchwise_conv(nn.Conv2d(3, 8, kernel_size=4, stride=4))
    model = tiny_model("qwen2_vl")
    embed = inner_model(model).visual.patch_embed
    embed.proj = nn.Conv3d(3, embed.proj.out_channels, kernel_size=(2, 14, 14), stride=(1, 14, 14))
    with pytest.raises(ValueError, match=r"kernels\.patch_embed=conv"):
        use_matmul_patch_embed(model)


def test_matmul_patch_embed_refuses_a_second_switch(tiny_model):
    model = tiny_model("qwen3_vl")
    use_matmul_patch_embed(model)
    with pytest.raises(ValueError, match="already"):
        use_matmul_patch_embed(model)


@pytest.mark.parametrize("choice", ["matmul", "conv"])
def test_training_setup_switches_the_patch_embedding_as_the_recipe_says(tmp_path, choice):
    """kernels.patch_embed=matmul reaches the model train.py builds; conv (the default) leaves transformers' own."""
    from accelerate.state import AcceleratorState

    from training.config import load_config
    from training.setup import build_accelerator, build_training

    overrides = [f"data.cache_dir={tmp_path}", "data.num_samples=16", "data.eval_fraction=0", "kernels.mrope=unfused"]
    overrides += ["logging.report_to=none", "logging.progress_bar=false", f"train.output_dir={tmp_path / 'run'}"]
    cfg = load_config("recipes/tiny-qwen2_5_vl.yaml", [*overrides, f"kernels.patch_embed={choice}"])
    assert load_config("recipes/tiny-qwen2_5_vl.yaml", overrides).kernels.patch_embed == "conv"
    try:
        setup = build_training(cfg, build_accelerator(cfg))
        embeds = [m for name, m in setup.module.named_modules() if name.endswith("visual.patch_embed")]
        assert len(embeds) == 1
        assert ("forward" in embeds[0].__dict__) is (choice == "matmul")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
