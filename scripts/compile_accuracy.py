"""How far regional compile moves one decoder layer's numbers, measured against float64 as well as against eager.

    python -m scripts.compile_accuracy [--hidden 512] [--tokens 512] [--device cpu|cuda]

One Qwen2 decoder layer (the text layer of Qwen2.5-VL: RMSNorm, GQA attention with biases, SwiGLU), fp32 parameters
under bf16 autocast as `train.master_weights=module` trains it, forward and backward of a fixed random input and
output gradient, run nine ways: eager; eager again; torch.compile with aot_eager (dynamo + AOTAutograd, no
codegen); inductor with `emulate_precision_casts` (the repo's default, `train.compile_emulate_precision_casts`);
inductor without it; inductor with it but the two RMSNorms left eager (a diagnostic: graph breaks, not how training
compiles); inductor with it calling aten's mean kernel, aten's kernels for the sums and means over each row, and
aten's sum and mean kernels (`train.compile_eager_reductions=mean`, `=rows` and `=all`). For each it prints the
relative error (‖a − b‖ / ‖b‖) of the output and of every gradient against the same layer in float64, and against
eager. A compiled layer "as accurate as eager" has float64 errors equal to eager's; its distance to eager is then
another rounding of the same accuracy (docs/benchmarks.md, thirteenth session: what that rounding does to a
30-step curve).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch
import torch._inductor.config
from torch import nn
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

from training.eager_reductions import lower_setting

Numbers = tuple[torch.Tensor, dict[str, torch.Tensor]]  # the output and every gradient (the input's as "input"), fp64


def build_layer(hidden: int, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """A random Qwen2 decoder layer of width `hidden` (3B-like ratios: 64-wide heads, 4 query heads per KV head, MLP
    2.69× wide) and its rotary embedding; norm weights near 1, matmul weights N(0, 0.02), biases N(0, 0.1)."""
    heads = hidden // 64
    config = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=hidden * 43 // 16,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    layer = Qwen2DecoderLayer(config, layer_idx=0).train()
    for name, param in layer.named_parameters():
        if "norm" in name:
            nn.init.normal_(param, mean=1.0, std=0.1)
        else:
            nn.init.normal_(param, std=0.02 if param.dim() > 1 else 0.1)
    return layer, Qwen2RotaryEmbedding(config)


def layer_numbers(
    layer: nn.Module,
    rope: nn.Module,
    inputs: torch.Tensor,
    out_grad: torch.Tensor,
    dtype: torch.dtype,
    wrap: Callable[[nn.Module], Callable] | None = None,
) -> Numbers:
    """One forward and backward of a copy of `layer` in `dtype` (bf16 autocast unless float64), `wrap`ped (compiled)."""
    model = copy.deepcopy(layer).to(dtype)
    x = inputs.clone().to(dtype).requires_grad_()
    positions = torch.arange(x.shape[1], device=x.device)[None]
    cos, sin = rope(x, positions)
    forward = wrap(model) if wrap else model
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=dtype != torch.float64):
        out = forward(x, position_embeddings=(cos.to(dtype), sin.to(dtype)), attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    (out.to(dtype) * out_grad.to(dtype)).sum().backward()
    grads = {name: p.grad.double() for name, p in model.named_parameters()}
    return out.detach().double(), {**grads, "input": x.grad.double()}


def compiled(
    backend: str, emulate_precision_casts: bool | None = None, eager_norms: bool = False
) -> Callable[[nn.Module], Callable]:
    """A wrapper that compiles a layer; `eager_norms` leaves its RMSNorms eager (graph breaks around them)."""

    def wrap(model: nn.Module) -> Callable:
        torch._dynamo.reset()
        if emulate_precision_casts is not None:
            torch._inductor.config.emulate_precision_casts = emulate_precision_casts
        if eager_norms:
            for name, module in model.named_modules():
                if name.endswith("layernorm"):
                    module.forward = torch.compiler.disable(module.forward)
        return torch.compile(model, backend=backend, dynamic=True)

    return wrap


def relative_errors(numbers: Numbers, reference: Numbers) -> tuple[float, list[float]]:
    """(the output's relative error, every gradient's) of `numbers` against `reference`."""

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    return error(numbers[0], reference[0]), [error(numbers[1][n], reference[1][n]) for n in reference[1]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512, help="layer width, a multiple of 256")
    parser.add_argument("--tokens", type=int, default=512, help="sequence length (one causal sample)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    layer, rope = build_layer(args.hidden)
    layer, rope = layer.to(args.device), rope.to(args.device)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(1, args.tokens, args.hidden, generator=generator).to(args.device)
    out_grad = torch.randn(1, args.tokens, args.hidden, generator=generator).to(args.device)
    reference = layer_numbers(layer, rope, inputs, out_grad, torch.float64)
    before = torch._inductor.config.emulate_precision_casts
    eager = layer_numbers(layer, rope, inputs, out_grad, torch.float32)
    runs = {
        "eager": eager,
        "eager again": layer_numbers(layer, rope, inputs, out_grad, torch.float32),
        "aot_eager": layer_numbers(layer, rope, inputs, out_grad, torch.float32, compiled("aot_eager")),
        "inductor, emulated casts": layer_numbers(
            layer, rope, inputs, out_grad, torch.float32, compiled("inductor", emulate_precision_casts=True)
        ),
        "inductor, fp32 intermediates": layer_numbers(
            layer, rope, inputs, out_grad, torch.float32, compiled("inductor", emulate_precision_casts=False)
        ),
        "inductor, emulated casts, RMSNorms eager": layer_numbers(
            layer, rope, inputs, out_grad, torch.float32, compiled("inductor", True, eager_norms=True)
        ),
    }
    for which, name in (
        ("mean", "aten's means"),
        ("rows", "aten's row sums and means"),
        ("all", "aten's sums and means"),
    ):
        undo = lower_setting(which)
        try:
            runs[f"inductor, emulated casts, {name}"] = layer_numbers(
                layer, rope, inputs, out_grad, torch.float32, compiled("inductor", True)
            )
        finally:
            undo()
    torch._inductor.config.emulate_precision_casts = before
    print(f"Qwen2 decoder layer, hidden {args.hidden}, {args.tokens} tokens, {args.device}, torch {torch.__version__}")
    columns = ("run", "output vs fp64", "gradients vs fp64 (median / max)", "output vs eager", "gradients vs eager")
    print("| " + " | ".join(columns) + " (median / max) |")
    print("|---|---:|---:|---:|---:|")
    for name, numbers in runs.items():
        out64, grads64 = relative_errors(numbers, reference)
        out_eager, grads_eager = relative_errors(numbers, eager)
        grads64.sort()
        grads_eager.sort()
        print(
            f"| {name} | {out64:.3e} | {grads64[len(grads64) // 2]:.3e} / {grads64[-1]:.3e} | {out_eager:.1e} | "
            f"{grads_eager[len(grads_eager) // 2]:.1e} / {grads_eager[-1]:.1e} |"
        )


if __name__ == "__main__":
    main()
