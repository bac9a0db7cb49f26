"""train.fp8 (modeling/fp8.py): that padding a pack's rows changes nothing, which linears go to float8, and how
`auto` and `true` resolve. torchao is optional (requirements-fp8.txt): the tests of its float8 linears (which run
emulated on the CPU) need it installed, the rest run everywhere."""

from __future__ import annotations

import dataclasses
import importlib.util
import types

import pytest
import torch
from torch import nn

from core.config import ConfigError, load_config
from modeling import fp8
from trainer import defaults

ACCELERATOR = types.SimpleNamespace(device=torch.device("cpu"), distributed_type="NO", num_processes=1)
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="needs torchao (pip install -r requirements-fp8.txt)"
)


def test_pad_rows_appends_zero_rows_to_a_multiple_of_16():
    x = torch.randn(2, 45, 8)
    padded, rows = fp8.pad_rows(x)
    assert rows == 90 and padded.shape == (96, 8)
    assert torch.equal(padded[:90], x.reshape(90, 8)) and not padded[90:].any()


@pytest.mark.parametrize("tokens", [45, 48, 1])
def test_row_padding_returns_the_linears_own_result(tokens):
    """A row-padded linear gives its base class's output and gradients bit for bit, on and off the multiple of 16
    (the padding's reshape, slice and gradient flow, on a plain nn.Linear)."""
    torch.manual_seed(0)
    plain = nn.Linear(32, 64)
    padded = nn.Linear(32, 64)
    padded.load_state_dict(plain.state_dict())
    padded.__class__ = fp8.row_padded(nn.Linear)
    x, dout = torch.randn(2, tokens, 32), torch.randn(2, tokens, 64)
    results = []
    for module in (plain, padded):
        leaf = x.clone().requires_grad_()
        out = module(leaf)
        out.backward(dout)
        results.append((out, leaf.grad, module.weight.grad, module.bias.grad))
    for got, expected in zip(results[1], results[0]):
        assert torch.equal(got, expected)


@needs_torchao
@pytest.mark.parametrize("tokens", [45, 48, 1])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_row_padded_float8_linear_equals_torchaos(tokens, recipe):
    """Padding the rows to a multiple of 16 gives torchao's Float8Linear's output and gradients bit for bit (zero
    rows change no amax and add nothing to the weight gradient), at token counts on and off the multiple."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    linear = nn.Linear(32, 64, bias=False).to(torch.bfloat16)
    config = Float8LinearConfig.from_recipe_name(recipe)
    plain = Float8Linear.from_float(nn.Linear(32, 64, bias=False).to(torch.bfloat16), config=config)
    plain.weight = nn.Parameter(linear.weight.detach().clone())
    padded = Float8Linear.from_float(linear, config=config)
    padded.__class__ = fp8.row_padded(Float8Linear)
    x = torch.randn(1, tokens, 32, dtype=torch.bfloat16)
    dout = torch.randn(1, tokens, 64, dtype=torch.bfloat16)
    results = []
    for module in (plain, padded):
        leaf = x.clone().requires_grad_()
        out = module(leaf)
        out.backward(dout)
        results.append((out, leaf.grad, module.weight.grad))
    for got, expected in zip(results[1], results[0]):
        assert torch.equal(got, expected)


@needs_torchao
def test_only_decoder_linears_go_to_float8(tiny_model):
    """Every eligible nn.Linear of the decoder layers is converted; the ViT, the mergers and the lm_head are not,
    and the state dict keeps its names (checkpoints load either way)."""
    model = tiny_model("qwen2_5_vl").to(torch.bfloat16)
    keys = set(model.state_dict())
    converted = fp8.convert_decoder_linears(model)
    from torchao.float8.float8_linear import Float8Linear

    row_padded = fp8.row_padded(Float8Linear)
    layers = model.model.language_model.layers
    decoder_linears = [m for m in layers.modules() if isinstance(m, nn.Linear)]
    assert converted == len(decoder_linears) > 0 and all(type(m) is row_padded for m in decoder_linears)
    elsewhere = [m for name, m in model.named_modules() if "language_model.layers" not in name]
    assert not any(isinstance(m, row_padded) for m in elsewhere)
    assert set(model.state_dict()) == keys


def test_fp8_auto_off_without_a_gpu_and_true_refused():
    """train.fp8=auto resolves to false on a host without float8 matmuls (and says why); true there is an error
    naming the cause, never a silent bf16 run."""
    cfg = load_config("recipes/tiny-qwen2_5_vl.yaml")
    assert defaults.resolve(cfg, ACCELERATOR).train.fp8 is False
    forced = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8=True))
    with pytest.raises(ConfigError, match=r"train.fp8=true cannot run here: no CUDA device"):
        defaults.resolve(forced, ACCELERATOR)
