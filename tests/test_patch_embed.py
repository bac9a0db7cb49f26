"""The ViT's patch embedding as a matrix product (modeling/patch_embed.py) against transformers' Conv3d, and its
gradients under both train.master_weights modes."""

import copy

import pytest
import torch
from torch import nn

from core.families import FAMILIES
from modeling import master_weights
from modeling.parts import inner_model
from modeling.patch_embed import is_patchwise_conv, use_matmul_patch_embed


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


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_matmul_patch_embed_under_bf16_autocast_is_as_close_as_the_convolution(tiny_model, family):
    """Under bf16 autocast (how training runs it): the output is bf16 and within one bf16 unit of the convolution's
    (the two add in different orders), and against an fp64 truth the weight's and bias's gradients, which come back
    in fp32, are off by no more than the convolution's own."""
    model = tiny_model(family)
    reference = copy.deepcopy(model)
    use_matmul_patch_embed(model)
    embed, conv_embed = inner_model(model).visual.patch_embed, inner_model(reference).visual.patch_embed
    pixels = _pixel_rows(embed, rows=64)
    upstream = torch.randn(64, embed.proj.out_channels, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, conv_out = embed(pixels), conv_embed(pixels)
    assert out.dtype == conv_out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), conv_out.float(), rtol=2**-7, atol=2**-7)
    grads = torch.autograd.grad(out, list(embed.parameters()), upstream.bfloat16())
    conv_grads = torch.autograd.grad(conv_out, list(conv_embed.parameters()), upstream.bfloat16())
    truth_embed = copy.deepcopy(conv_embed).double()
    truth = torch.autograd.grad(truth_embed(pixels.double()), list(truth_embed.parameters()), upstream.double())
    for grad, conv_grad, exact in zip(grads, conv_grads, truth, strict=True):
        assert grad.dtype == torch.float32
        conv_error = (conv_grad.double() - exact).abs().max()
        assert conv_error > 0, "the bf16 convolution did not round"
        assert (grad.double() - exact).abs().max() <= conv_error


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_images_and_videos_give_both_master_weight_modes_the_same_gradient(tiny_model, family):
    """A pack calls the patch embedding twice (images, then videos). Under bf16 autocast, module mode (fp32 weights)
    and train.master_weights=optimizer (which keeps the patch embedding fp32) get the same weight and bias gradients
    bit for bit, for every family (with a bias: Qwen3-VL, Qwen3.5); each is the fp32 sum of the two calls' own."""
    module_mode = tiny_model(family)
    use_matmul_patch_embed(module_mode)
    optimizer_mode = copy.deepcopy(module_mode)
    master_weights.MasterWeights(optimizer_mode, torch.bfloat16, torch.device("cpu"))
    embed = inner_model(optimizer_mode).visual.patch_embed
    assert {p.dtype for p in embed.parameters()} == {torch.float32}
    images, videos = _pixel_rows(embed, rows=24), _pixel_rows(embed, rows=40).flip(0)
    upstream = torch.randn(64, embed.proj.out_channels, generator=torch.Generator().manual_seed(2)).bfloat16()

    def patch_embed_grads(model, calls):
        embed = inner_model(model).visual.patch_embed
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = [embed(pixels) for pixels in calls]
        torch.autograd.backward(outs, [upstream[: len(pixels)] for pixels in calls])
        grads = [p.grad.clone() for p in embed.parameters()]
        embed.zero_grad(set_to_none=True)
        return grads

    both = patch_embed_grads(module_mode, [images, videos])
    assert len(both) == (2 if embed.proj.bias is not None else 1)
    for grad, grad_o in zip(both, patch_embed_grads(optimizer_mode, [images, videos]), strict=True):
        assert grad.dtype == grad_o.dtype == torch.float32 and torch.equal(grad, grad_o)
    first, second = patch_embed_grads(module_mode, [images]), patch_embed_grads(module_mode, [videos])
    for grad, a, b in zip(both, first, second, strict=True):
        assert torch.equal(grad, a + b)


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
    """kernels.patch_embed=matmul (the default) reaches the model train.py builds; conv leaves transformers' own."""
    from accelerate.state import AcceleratorState

    from core.config import load_config
    from trainer.setup import build_accelerator, build_training

    overrides = [f"data.cache_dir={tmp_path}", "data.num_samples=16", "data.eval_fraction=0", "kernels.mrope=unfused"]
    overrides += ["logging.report_to=none", "logging.progress_bar=false", f"train.output_dir={tmp_path / 'run'}"]
    cfg = load_config("recipes/tiny-qwen2_5_vl.yaml", [*overrides, f"kernels.patch_embed={choice}"])
    assert load_config("recipes/tiny-qwen2_5_vl.yaml", overrides).kernels.patch_embed == "matmul"
    try:
        setup = build_training(cfg, build_accelerator(cfg))
        embeds = [m for name, m in setup.module.named_modules() if name.endswith("visual.patch_embed")]
        assert len(embeds) == 1
        assert ("forward" in embeds[0].__dict__) is (choice == "matmul")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
