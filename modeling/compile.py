"""Regional torch.compile (torchtitan's pattern): each text decoder layer and each ViT block compiled in place.

One compiled region per block rather than one whole-model graph: every layer of a stack shares its code, so dynamo
traces one layer and reuses the code for the others (compile time grows with the number of distinct blocks, not
with depth), and the model's own Python — vision/text merge, deepstack, position bookkeeping, the loss — stays eager.
Inside a block inductor fuses the elementwise work around the matmuls (RMSNorm, residual add + RMSNorm, SwiGLU), so
no hand-written kernel is needed.

Dynamic shapes: a pack's token count, sample count and longest sample change every step, so blocks compile with
`dynamic=True` (sizes that meet a parameter's, like the hidden width, specialize to it; the token axis, the
number of boundaries and `max_seqlen` stay symbolic), and the packed attention reads no host-side sample length
while compiling (modeling/packed.py). Packs of any shape then reuse the first graph.

What is compiled, and with `fullgraph=True` (a graph break is an error, not a silent slowdown):
- every decoder layer of the language model: attention, the fused rope custom op (`mrope_kernels::rope`), the
  packed attention (varlen kernel on CUDA, one masked SDPA call elsewhere), MLP or MoE block, norms, residuals;
- every ViT block (Qwen2.5-VL's windowed and full-attention blocks alike: they differ only in the boundaries
  they receive).
Excluded: Qwen3.5's Gated DeltaNet mixers run eagerly (`torch.compiler.disable`). Their packed forward splits on
host lengths (torch path) or calls fla's Triton autotuned kernels, and the torch delta rule loops over chunks:
traced, each would recompile for every pack. Their decoder layers compile with `fullgraph=False`, so the norms,
residuals and MLP around the mixer still compile (two graphs per such layer). Such a layer's compiled frame only
hands the pack (`packed_seqlens`: a PackedSeqlens, or a context-parallel ContextShard) on to the mixer, so it gets it
boxed in a plain object (`PassedThrough`) that the mixer's eager wrapper unboxes: dynamo guards on the box's type
and on nothing inside. Given the pack itself, a frozen dataclass, dynamo (torch 2.11) builds a variable for every
field, and `len(sample_lengths) == n` becomes a guard that recompiles the layer for every new sample count.
Full-attention layers take the pack unboxed and read only its `cu_seqlens` and `max_seqlen`. Also eager:
embeddings, patch embedding, mergers (deepstack's included), rotary modules, the final norm and the LM head.

Numerics: inductor rounds fused intermediates to bf16 where eager stores bf16 (`emulate_precision_casts`), and the
norms' row reductions run on aten's kernels (modeling/eager_reductions.py), so a compiled block's forward and input
gradients add in eager's order; matmul dimensions that are not a multiple of 8 are padded (`force_shape_pad`), so
cuBLAS runs its Hopper kernels instead of an sm80 fallback for 4-byte alignment (Qwen2.5-VL's ViT MLPs are 3420
wide). docs/numerics.md says how the compiled curve is checked against eager's; docs/performance.md what each
setting costs.

Gradient checkpointing stays outside the compiled region. What is compiled is the block's own forward (the class's,
without transformers' checkpointing wrapper); the block's `forward` becomes an eager function that checkpoints the
compiled forward when checkpointing is on and calls it directly otherwise. The backward's recompute therefore calls
the same compiled forward again (no re-trace, no eager fallback), and a layer whose forward has a graph break (a
Qwen3.5 Gated DeltaNet layer) still compiles around it. Compiling the module call instead (`_call_impl`, through
transformers' wrapper) does not work for Qwen3.5: under checkpointing dynamo traces the checkpoint as one
higher-order op, which cannot hold a graph break, so every decoder layer would run eagerly; and since every block's
call is the wrapper's one code object, a full-attention layer would reuse a Gated DeltaNet layer's cached code (its
guards never read the layer type). Module hooks (FSDP2's) run eagerly around the compiled forward, outside the
checkpoint, as transformers' own wrapper keeps them.

Compilation happens lazily, at the first forward of each block: the first training step carries it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from collections.abc import Callable

import torch
import torch._inductor.config
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from modeling import gated_delta
from modeling.packed import PACK_KWARG
from modeling.parts import inner_model

log = logging.getLogger(__name__)

_STATE_ATTR = "_regional_compile"
# Without duck shaping every dynamic size gets its own symbol: with it, sizes equal by chance in the first pack
# (a sample count and a position count, say) are assumed equal, and the next pack recompiles.
_DISTINCT_SYMBOLS = torch.fx.experimental._config.patch(use_duck_shape=False)
# The blocks of one class share one code object (their forward), so dynamo's per-code recompile limit (8) counts the
# variants of all of them together: Qwen2.5-VL's windowed and full-attention ViT blocks, a first block whose input is
# a view, Qwen3.5's linear- and full-attention layers, each in training and in eval (grad mode). Bounded (pack shapes
# add none), but it can exceed 8.
RECOMPILE_LIMIT = 64
# Inductor settings compile_blocks holds for the run (module docstring: Numerics)
INDUCTOR_SETTINGS = {"emulate_precision_casts": True, "force_shape_pad": True}


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What `compile_blocks` compiled: module paths per kind, and the Gated DeltaNet mixers left eager."""

    fullgraph: tuple[str, ...]  # blocks compiled as one graph each
    with_eager_mixer: tuple[str, ...]  # decoder layers compiled around an eager Gated DeltaNet mixer
    eager_mixers: tuple[str, ...]
    dynamo_config: dict  # the dynamo settings compile_blocks changed, as they were before
    inductor_config: dict  # likewise for inductor's
    undo_norm_reductions: Callable[[], None]  # puts inductor's own reductions back

    def __str__(self) -> str:
        return (
            f"regional compile: {len(self.fullgraph)} blocks fullgraph, {len(self.with_eager_mixer)} decoder layers "
            f"around {len(self.eager_mixers)} eager Gated DeltaNet mixers; norms' row reductions on aten's kernels; "
            "compiles at the first step"
        )


def compile_blocks(model: nn.Module, backend: str | Callable = "inductor") -> CompileReport:
    """Compile every decoder layer of `model.model.language_model.layers` and every ViT block of
    `model.model.visual.blocks` in place, with dynamic shapes; call it after the rope patch, the packed forward,
    freezing and gradient checkpointing, before accelerate wraps the model.

    backend: torch.compile's backend ("inductor"; tests use "aot_eager"). Sets inductor's INDUCTOR_SETTINGS and
    lowers the norms' row reductions to aten's kernels for as long as the blocks stay compiled (module docstring:
    Numerics). Each block's own forward is compiled and set as the block's `forward`, inside an eager gradient
    checkpoint when the block checkpoints. Parameters, buffers and state-dict keys are unchanged. Raises dynamo's
    recompile limit to RECOMPILE_LIMIT and makes hitting it an error. Raises ValueError if the model is already
    compiled, has no such blocks, or a block already has a forward of its own. Undo with `uncompile_blocks(model)`.
    """
    # inductor's lowering tables (most of a second to import): loaded by a run that compiles, not by every run
    from modeling.eager_reductions import lower_norm_reductions

    if getattr(model, _STATE_ATTR, None) is not None:
        raise ValueError("this model's blocks are already compiled.")
    inner = inner_model(model)
    named = [
        ("model.language_model.layers", inner.language_model, "layers"),
        ("model.visual.blocks", inner.visual, "blocks"),
    ]
    dynamo_config = {"recompile_limit": torch._dynamo.config.recompile_limit}
    dynamo_config["fail_on_recompile_limit_hit"] = torch._dynamo.config.fail_on_recompile_limit_hit
    inductor_config = {name: getattr(torch._inductor.config, name) for name in INDUCTOR_SETTINGS}
    fullgraph, with_mixer, mixers = [], [], []
    for prefix, parent, attr in named:
        blocks = getattr(parent, attr, None)
        if not isinstance(blocks, nn.ModuleList) or not len(blocks):
            raise ValueError(f"{type(model).__name__} has no {prefix} to compile.")
        for index, block in enumerate(blocks):
            path = f"{prefix}.{index}"
            if "forward" in block.__dict__:
                raise ValueError(f"{path} has a forward of its own, which compile_blocks would replace.")
            block_mixers = [
                (name, m) for name, m in block.named_modules() if m in gated_delta.gated_delta_layers(block)
            ]
            for name, mixer in block_mixers:
                # Keep the instance forward the packed forward installed (or the class's): uncompile restores it.
                mixer._forward_before_compile = mixer.__dict__.get("forward")
                unboxing = functools.partial(unboxed_pack_call, mixer.forward)
                mixer.forward = torch.compiler.disable(unboxing, reason="Gated DeltaNet runs eagerly")
                mixers.append(f"{path}.{name}")
            compiled = torch.compile(own_forward(block), backend=backend, dynamic=True, fullgraph=not block_mixers)
            compiled = _DISTINCT_SYMBOLS(compiled)
            if block_mixers:  # the compiled frame only hands the pack on to the mixer: box it (module docstring)
                compiled = functools.partial(boxed_pack_call, compiled)
            block.forward = functools.partial(_checkpointed_forward, block, compiled)
            (with_mixer if block_mixers else fullgraph).append(path)
    # Past the limit dynamo would silently run the block eagerly: make that an error instead.
    torch._dynamo.config.recompile_limit = max(RECOMPILE_LIMIT, dynamo_config["recompile_limit"])
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    # Read when a block compiles (its first forward), so they stay set until uncompile_blocks.
    for name, value in INDUCTOR_SETTINGS.items():
        setattr(torch._inductor.config, name, value)
    report = CompileReport(
        tuple(fullgraph), tuple(with_mixer), tuple(mixers), dynamo_config, inductor_config, lower_norm_reductions()
    )
    setattr(model, _STATE_ATTR, report)
    log.info("%s", report)
    return report


def compile_report(model: nn.Module) -> CompileReport | None:
    """The report of `compile_blocks` while `model`'s blocks are compiled, else None."""
    return getattr(model, _STATE_ATTR, None)


def uncompile_blocks(model: nn.Module) -> None:
    """Undo `compile_blocks`: every block runs eagerly again (the Gated DeltaNet mixers' forwards restored)."""
    report = compile_report(model)
    if report is None:
        raise ValueError("this model's blocks are not compiled.")
    for path in (*report.fullgraph, *report.with_eager_mixer):
        del model.get_submodule(path).forward
    for path in report.eager_mixers:
        mixer = model.get_submodule(path)
        previous = mixer.__dict__.pop("_forward_before_compile")
        if previous is None:
            del mixer.forward
        else:
            mixer.forward = previous
    for name, value in report.dynamo_config.items():
        setattr(torch._dynamo.config, name, value)
    for name, value in report.inductor_config.items():
        setattr(torch._inductor.config, name, value)
    report.undo_norm_reductions()
    setattr(model, _STATE_ATTR, None)


def own_forward(block: nn.Module) -> Callable:
    """`block`'s forward as its class defines it, bound to `block`, without transformers' checkpointing wrapper
    (`GradientCheckpointingLayer` wraps every subclass's forward in one that checkpoints it)."""
    forward = type(block).forward
    if isinstance(block, GradientCheckpointingLayer):
        forward = forward.__wrapped__
    return types.MethodType(forward, block)


class PassedThrough:
    """A value a compiled frame only passes on, never reads. A plain object (not a dataclass, a tuple or a
    container, whose contents dynamo tracks): dynamo guards on its type alone, so a new value reuses the graph."""

    __slots__ = ("value",)

    def __init__(self, value: object):
        self.value = value


def boxed_pack_call(compiled: Callable, *args, **kwargs):
    """Call the compiled forward of a layer around an eager mixer with the pack boxed (`PassedThrough`)."""
    if kwargs.get(PACK_KWARG) is not None:
        kwargs[PACK_KWARG] = PassedThrough(kwargs[PACK_KWARG])
    return compiled(*args, **kwargs)


def unboxed_pack_call(forward: Callable, *args, **kwargs):
    """Call an eager mixer's `forward` with the pack out of its box (`boxed_pack_call`)."""
    if isinstance(kwargs.get(PACK_KWARG), PassedThrough):
        kwargs[PACK_KWARG] = kwargs[PACK_KWARG].value
    return forward(*args, **kwargs)


def _checkpointed_forward(block: nn.Module, compiled: Callable, *args, **kwargs):
    """What transformers' wrapper does, around the compiled forward: checkpoint it with the block's checkpoint
    function while the block trains with checkpointing on (tensors positional, keywords bound), else call it. The
    wrapper drops a KV cache under checkpointing; training passes none, and one here is refused."""
    if not (getattr(block, "gradient_checkpointing", False) and block.training):
        return compiled(*args, **kwargs)
    if kwargs.get("past_key_values") is not None:
        raise ValueError("a compiled block does not take a KV cache under gradient checkpointing (use_cache=False).")
    return block._gradient_checkpointing_func(functools.partial(compiled, **kwargs), *args)
