"""Regional torch.compile (modeling/compile.py): compiled blocks compute what eager blocks compute, the attention
blocks trace as one graph each, and packs of new lengths and sample counts reuse the first pack's graphs.

Backend aot_eager (dynamo + AOTAutograd, no inductor codegen): it checks tracing, dynamic shapes and the joint
forward/backward graph on CPU in seconds; inductor's own codegen is exercised by the GPU run. The fused rope runs
its Triton kernels under the interpreter (conftest); the GPU attention path is traced on CPU stand-ins of torch's
varlen kernels; FSDP2 runs over gloo.
"""

import copy
import json
import logging
import os
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import train
from core.config import load_config
from data.processing import IGNORE_INDEX
from lifecycle.run_files import read_metrics
from modeling import attention_engines, gated_delta, packed, parts
from modeling import compile as regional
from modeling.eager_reductions import (
    LAYER_NORM_OPS,
    ROW_OPS,
    decomposition_tables,
    lower_norm_reductions,
    overloads,
    reduces_rows_only,
)
from modeling.packed import PACK_KWARG, enable_packed_forward, packed_model_inputs
from mrope_kernels.patch import patch_model
from tests.test_distributed import WORKER_EXIT
from tests.tiers import tiered
from verification.launch import run_logged
from verification.packing_check import SampleSpec, label_loss, pack_samples

# Four packs, each of another length and sample count (1 to 5 samples), images at the start, middle and end.
PACKS = (
    (SampleSpec(0, ((4, 4),), text_after=9), SampleSpec(20), SampleSpec(3)),
    (SampleSpec(30), SampleSpec(3, ((2, 4), (4, 2)), text_between=3), SampleSpec(5), SampleSpec(7)),
    (SampleSpec(50, ((4, 4),), text_after=4),),
    (SampleSpec(12), SampleSpec(9), SampleSpec(2, ((4, 4),), text_after=0), SampleSpec(8), SampleSpec(11)),
)
ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5  # fp32: the masked SDPA that compiled CPU attention runs sums in another order than per segment


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    """Every test compiles from scratch (dynamo's caches hang off the shared layer code, not off one model) and
    leaves dynamo and inductor as it found them: every model a test compiled and left compiled is uncompiled at its
    end (compile_blocks' inductor settings and norm lowerings are process-wide)."""
    torch._dynamo.reset()
    counters.clear()
    compiled = []
    compile_blocks = regional.compile_blocks

    def recording(model, *args, **kwargs):
        report = compile_blocks(model, *args, **kwargs)
        compiled.append(model)
        return report

    monkeypatch.setattr(regional, "compile_blocks", recording)
    yield
    for model in reversed(compiled):
        if regional.compile_report(model) is not None:
            regional.uncompile_blocks(model)
    torch._dynamo.reset()


def packed_model(tiny_model, family: str, checkpointing: bool | int = False) -> torch.nn.Module:
    """A tiny model as training prepares it: fused rope, packed forward, optionally gradient checkpointing (of every
    block, or of the first N of each stack)."""
    model = tiny_model(family)
    patch_model(model)
    enable_packed_forward(model)
    parts.enable_gradient_checkpointing(model, llm=checkpointing, vision=checkpointing)
    return model.train()


def loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean label loss of one pack and every parameter's gradient (gradients reset first)."""
    model.zero_grad(set_to_none=True)
    logits = model(**packed_model_inputs(model, batch), use_cache=False).logits
    loss = label_loss(logits, batch["shift_labels"], int((batch["shift_labels"] != IGNORE_INDEX).sum()))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def compiled_graphs(counter: CompileCounterWithBackend) -> int:
    """Graphs the backend compiled, less the empty ones dynamo hands it when it restarts a trace (e.g. to
    specialize a float it first traced as a tensor)."""
    return sum(any(node.op == "call_function" for node in graph.graph.nodes) for graph in counter.graphs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    error = (actual - expected).abs().max().item()
    assert error <= TOLERANCE * max(1.0, expected.abs().max().item()), f"{name}: max error {error:.3g}"


@pytest.mark.parametrize(
    ("family", "checkpointing"),
    [
        ("qwen2_5_vl", False),
        pytest.param("qwen3_vl", True, marks=pytest.mark.slow),
        pytest.param("qwen3_5", False, marks=pytest.mark.slow),
        pytest.param("qwen3_5", True, marks=pytest.mark.slow),
        pytest.param("qwen3_5", 1, marks=pytest.mark.slow),
    ],
)
def test_compiled_blocks_equal_eager(tiny_model, tiny_samples, family, checkpointing):
    """Loss and every parameter gradient of compiled blocks equal the eager model's (fp32) over packs of different
    shapes: Qwen2.5-VL's windowed and full-attention ViT blocks, Qwen3.5's decoder layers around eager Gated DeltaNet
    mixers, and with gradient checkpointing replaying compiled layers, of every block or of the first of each stack
    (1: the others keep their activations)."""
    eager = packed_model(tiny_model, family, checkpointing)
    compiled = packed_model(tiny_model, family, checkpointing)
    regional.compile_blocks(compiled, backend="aot_eager")
    for seed, specs in enumerate(PACKS[:2]):
        batch = pack_samples(eager, tiny_samples(eager, specs, seed=seed))
        loss, grads = loss_and_grads(compiled, batch)
        expected_loss, expected_grads = loss_and_grads(eager, batch)
        assert_close(loss, expected_loss, "loss")
        assert grads.keys() == expected_grads.keys()
        for name, grad in grads.items():
            assert_close(grad, expected_grads[name], name)


@pytest.mark.parametrize(("family", "checkpointing"), [("qwen2_5_vl", True), ("qwen3_5", False)])
@pytest.mark.slow
def test_compiled_lora_blocks_equal_eager(tiny_model, tiny_samples, family, checkpointing):
    """With LoRA adapters in the decoder layers and ViT blocks (lora_B drawn at random), every attention block still
    compiles as one graph (peft's LoRA Linear traces in fullgraph), and the loss and every adapter gradient equal the
    eager adapted model's (fp32), with gradient checkpointing replaying the compiled layers too."""
    from tests.test_lora import adapted

    eager, compiled = (packed_model(tiny_model, family, checkpointing) for _ in range(2))
    for model in (eager, compiled):
        torch.manual_seed(0)  # the same lora_A initialisation on both
        adapted(model, vision=True)
    report = regional.compile_blocks(compiled, backend="aot_eager")
    assert report.fullgraph  # every block but Qwen3.5's Gated DeltaNet layers
    for seed, specs in enumerate(PACKS[:2]):
        batch = pack_samples(eager, tiny_samples(eager, specs, seed=seed))
        loss, grads = loss_and_grads(compiled, batch)
        expected_loss, expected_grads = loss_and_grads(eager, batch)
        assert_close(loss, expected_loss, "loss")
        assert grads.keys() == expected_grads.keys() and all("lora_" in name for name in grads)
        for name, grad in grads.items():
            assert_close(grad, expected_grads[name], name)


def _first_call_inputs(model: torch.nn.Module, block: torch.nn.Module, batch: dict) -> tuple[tuple, dict]:
    """The positional and keyword arguments `block` receives in an eager forward of `batch`."""
    seen = []
    handle = block.register_forward_pre_hook(lambda _, args, kwargs: seen.append((args, kwargs)), with_kwargs=True)
    with torch.no_grad():
        model(**packed_model_inputs(model, batch), use_cache=False)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("part", ["text", "vision"])
@pytest.mark.slow
def test_attention_block_is_one_graph_and_equals_eager(tiny_model, tiny_samples, family, part):
    """A text decoder layer with full attention (fused rope custom op, packed attention, MLP) and a ViT block trace
    with zero graph breaks; compiled with fullgraph=True, forward and backward equal eager (fp32)."""
    model = packed_model(tiny_model, family)
    blocks = model.model.language_model.layers if part == "text" else model.model.visual.blocks
    block = next(b for b in blocks if not gated_delta.gated_delta_layers(b))
    batch = pack_samples(model, tiny_samples(model, PACKS[0]))
    args, kwargs = _first_call_inputs(model, block, batch)
    hidden = args[0].detach().requires_grad_()

    explanation = torch._dynamo.explain(block)(hidden, *args[1:], **kwargs)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons

    compiled = torch.compile(block, backend="aot_eager", dynamic=True, fullgraph=True)
    outputs = []
    for run in (compiled, block):
        hidden.grad = None
        block.zero_grad(set_to_none=True)
        out = run(hidden, *args[1:], **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        outputs.append((out.detach(), hidden.grad.clone(), [p.grad.clone() for p in block.parameters()]))
    (out, grad_in, grads), (expected_out, expected_grad_in, expected_grads) = outputs
    assert_close(out, expected_out, "output")
    assert_close(grad_in, expected_grad_in, "input gradient")
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert_close(grad, expected, "parameter gradient")


@pytest.mark.slow
def test_gated_delta_layer_breaks_only_around_its_eager_mixer(tiny_model, tiny_samples):
    """A Qwen3.5 linear-attention decoder layer compiles around its Gated DeltaNet mixer: exactly one graph break,
    the `torch.compiler.disable` that keeps the mixer eager."""
    model = packed_model(tiny_model, "qwen3_5")
    regional.compile_blocks(model, backend="aot_eager")
    layer = next(b for b in model.model.language_model.layers if gated_delta.gated_delta_layers(b))
    batch = pack_samples(model, tiny_samples(model, PACKS[0]))
    args, kwargs = _first_call_inputs(model, layer, batch)
    explanation = torch._dynamo.explain(regional.own_forward(layer))(*args, **kwargs)
    assert explanation.graph_break_count == 1
    assert "Gated DeltaNet runs eagerly" in str(explanation.break_reasons[0])


@pytest.mark.slow
def test_gated_delta_layers_pass_the_pack_boxed_through_the_compiled_frame(tiny_model, tiny_samples, monkeypatch):
    """The pack reaches each eager mixer through its layer's compiled frame in a plain box, never as the frozen
    dataclass itself: given that, torch 2.11's dynamo guards on its sample count and recompiles every new pack (the
    local torch does not, so the recompile test alone cannot catch a regression here)."""
    handed_over = []
    unbox = regional.unboxed_pack_call

    def recording_unbox(forward, *args, **kwargs):
        handed_over.append(type(kwargs.get(PACK_KWARG)))
        return unbox(forward, *args, **kwargs)

    monkeypatch.setattr(regional, "unboxed_pack_call", recording_unbox)
    model = packed_model(tiny_model, "qwen3_5")
    report = regional.compile_blocks(model, backend="aot_eager")
    try:
        batch = pack_samples(model, tiny_samples(model, PACKS[1]))
        with torch.no_grad():
            model(**packed_model_inputs(model, batch), use_cache=False)
    finally:
        regional.uncompile_blocks(model)
    assert len(handed_over) == len(report.eager_mixers) > 0
    assert set(handed_over) == {regional.PassedThrough}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
@pytest.mark.slow
def test_packs_of_new_shapes_reuse_the_first_graphs(tiny_model, tiny_samples, family):
    """After the first pack (and gradient checkpointing on), packs of other lengths and sample counts compile
    nothing new: any recompile is an error. The first pack compiles at most two graphs per kind of block (text
    layer, full-attention and windowed ViT block, the pieces around a Gated DeltaNet mixer). Qwen3.5's Gated DeltaNet
    layers get the pack boxed, so torch 2.11's dynamo cannot guard on `len(...sample_lengths)` at the mixer's graph
    break and recompile for every new sample count."""
    model = packed_model(tiny_model, family, checkpointing=True)
    counter = CompileCounterWithBackend("aot_eager")
    regional.compile_blocks(model, backend=counter)
    batches = [pack_samples(model, tiny_samples(model, specs, seed=seed)) for seed, specs in enumerate(PACKS)]
    assert len({b["input_ids"].shape[1] for b in batches}) == len({len(b["sample_lengths"]) for b in batches}) == 4
    loss_and_grads(model, batches[0])
    first_pack_graphs = compiled_graphs(counter)
    kinds = {"qwen2_5_vl": 3, "qwen3_5": 4}[family]  # text, ViT (+ windowed ViT / + before and after the mixer)
    assert 0 < first_pack_graphs <= 2 * kinds
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in batches[1:]:
            loss_and_grads(model, batch)
    assert compiled_graphs(counter) == first_pack_graphs


class GraphRuns:
    """An aot_eager-like backend that counts how often the compiled forward and backward graphs run."""

    def __init__(self):
        self.runs = Counter()
        self.backend = aot_autograd(fw_compiler=self._counted("forward"), bw_compiler=self._counted("backward"))

    def _counted(self, kind: str):
        def compiler(graph: torch.fx.GraphModule, _example_inputs):
            def run(args):
                self.runs[kind] += 1
                return graph(*args)

            run._boxed_call = True
            return run

        return compiler


def _set_checkpointing(blocks: list[torch.nn.Module], enabled: bool) -> None:
    for block in blocks:
        block.gradient_checkpointing = enabled


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
@pytest.mark.slow
def test_checkpointing_replays_the_compiled_forward(tiny_model, tiny_samples, family):
    """With gradient checkpointing on (text layers and ViT blocks), every block runs compiled code in the forward and
    again in the backward's recompute: per pack, every block runs its compiled forward graphs (one, or two around an
    eager Gated DeltaNet mixer) once with checkpointing off and twice with it on, and the backward graphs once either
    way, so no block falls back to eager. Turning checkpointing on or off and packs of new shapes compile nothing;
    loss and gradients are the same either way. Qwen3.5 included: a checkpoint traced inside the compiled region
    cannot hold the mixer's graph break, and its whole layer ran eagerly."""
    model = packed_model(tiny_model, family, checkpointing=True)
    blocks = [*model.model.language_model.layers, *model.model.visual.blocks]
    counter = GraphRuns()
    report = regional.compile_blocks(model, backend=counter.backend)
    graphs_per_pack = len(report.fullgraph) + 2 * len(report.with_eager_mixer)
    batches = [pack_samples(model, tiny_samples(model, specs, seed=seed)) for seed, specs in enumerate(PACKS[:3])]
    loss_and_grads(model, batches[0])
    results, runs = {}, {}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for checkpointing in (False, True):
            _set_checkpointing(blocks, checkpointing)
            counter.runs.clear()
            results[checkpointing] = loss_and_grads(model, batches[1])
            runs[checkpointing] = dict(counter.runs)
        loss_and_grads(model, batches[2])
    assert runs[False] == {"forward": graphs_per_pack, "backward": graphs_per_pack}
    assert runs[True] == {"forward": 2 * graphs_per_pack, "backward": graphs_per_pack}
    (loss, grads), (expected_loss, expected_grads) = results[True], results[False]
    assert_close(loss, expected_loss, "loss")
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, expected_grads[name], name)


def test_uncompile_restores_eager_blocks(tiny_model):
    """`uncompile_blocks` undoes `compile_blocks`: no block keeps a forward of its own (the compiled one), the Gated
    DeltaNet mixers get the packed forward back; compiling twice is refused."""
    model = packed_model(tiny_model, "qwen3_5")
    blocks = [*model.model.language_model.layers, *model.model.visual.blocks]
    mixers = gated_delta.gated_delta_layers(model)
    packed_forwards = [m.forward for m in mixers]
    report = regional.compile_blocks(model, backend="aot_eager")
    assert len(report.fullgraph) + len(report.with_eager_mixer) == len(model.model.language_model.layers) + len(
        model.model.visual.blocks
    )
    assert len(report.eager_mixers) == len(mixers)
    with pytest.raises(ValueError, match="already compiled"):
        regional.compile_blocks(model, backend="aot_eager")
    assert all("forward" in block.__dict__ for block in blocks)
    regional.uncompile_blocks(model)
    assert not any("forward" in block.__dict__ for block in blocks)
    assert [m.forward for m in mixers] == packed_forwards


def test_compile_sets_inductors_eager_roundings_and_padding_until_uncompiled(tiny_model):
    """Inductor rounds fused intermediates as eager does and pads matmuls (force_shape_pad) for the whole run (blocks
    compile at their first forward); uncompile puts the previous values back."""
    model = packed_model(tiny_model, "qwen2_5_vl")
    with torch._inductor.config.patch(emulate_precision_casts=False, force_shape_pad=False):
        regional.compile_blocks(model, backend="aot_eager")
        assert torch._inductor.config.emulate_precision_casts and torch._inductor.config.force_shape_pad
        regional.uncompile_blocks(model)
        assert not torch._inductor.config.emulate_precision_casts and not torch._inductor.config.force_shape_pad


def test_norm_reductions_go_to_aten_until_uncompiled(tiny_model):
    """Compiling makes the layer norms (every overload) aten fallbacks with no decomposition left in inductor's
    tables to bypass them, gives sum.dim_IntList and mean.dim a lowering that sends a reduction over the last
    dimension alone to aten, and turns inductor's compile caches off (a cached graph would have inductor's own
    reductions); uncompile puts the lowerings, the decompositions, the fallback sets and the caches back."""
    from torch._inductor import lowering

    tracked = (*overloads(LAYER_NORM_OPS), *ROW_OPS)
    before = {op: lowering.lowerings.get(op) for op in tracked}
    tables_before = [dict(table) for table in decomposition_tables()]
    assert torch.ops.aten.native_layer_norm.default in tables_before[0]  # inductor decomposes it unless told not to
    fallbacks, realized = set(lowering.fallbacks), set(lowering.needs_realized_inputs)
    caches = (torch._inductor.config.fx_graph_cache, torch._functorch.config.enable_autograd_cache)
    model = packed_model(tiny_model, "qwen2_5_vl")
    report = regional.compile_blocks(model, backend="aot_eager")
    assert "norms' row reductions on aten's kernels" in str(report)
    assert all(lowering.lowerings[op]._is_fallback_handler for op in overloads(LAYER_NORM_OPS))
    assert not any(op in table for op in overloads(LAYER_NORM_OPS) for table in decomposition_tables())
    assert all(getattr(lowering.lowerings[op], "rows_to_aten", False) for op in ROW_OPS)
    assert not torch._inductor.config.fx_graph_cache and not torch._functorch.config.enable_autograd_cache
    regional.uncompile_blocks(model)
    assert {op: lowering.lowerings.get(op) for op in tracked} == before
    assert [dict(table) for table in decomposition_tables()] == tables_before
    assert set(lowering.fallbacks) == fallbacks and set(lowering.needs_realized_inputs) == realized
    assert (torch._inductor.config.fx_graph_cache, torch._functorch.config.enable_autograd_cache) == caches
    assert not any(getattr(op, "_is_fallback_handler", False) for op in before.values())


@pytest.mark.parametrize(
    ("dims", "rank", "rows_only"),
    [
        ([-1], 3, True),
        ([2], 3, True),
        (1, 2, True),
        ([0], 2, False),
        ([0, 1], 3, False),
        ([1, 2], 3, False),
        (None, 3, False),
        ([], 2, False),
        ([0], 1, True),
    ],
)
def test_which_reductions_are_row_reductions(dims, rank, rows_only):
    """A norm's mean of squares and its backward's sum over the hidden width reduce the last dimension alone; sums
    over tokens (weight and bias gradients), over several dimensions or over everything do not (a 1-D tensor's one
    dimension is its last)."""
    assert reduces_rows_only(dims, rank) is rows_only


@pytest.mark.slow
def test_inductor_rounds_as_eager_only_with_emulated_casts():
    """Why compile_blocks sets inductor's emulate_precision_casts: a bf16 elementwise chain compiled by inductor equals
    eager bit for bit only when inductor rounds each intermediate to bf16 as eager stores it; by default it keeps
    them in fp32 (another rounding, which training's unstable steps amplify: docs/numerics.md)."""

    def chain(x, y):
        return (x * y + x) * y - x

    x, y = torch.randn(2, 4096, dtype=torch.bfloat16).unbind()
    eager = chain(x, y)
    for emulate in (True, False):
        torch._dynamo.reset()
        with torch._inductor.config.patch(emulate_precision_casts=emulate):
            compiled = torch.compile(chain, backend="inductor")(x, y)
        assert torch.equal(compiled, eager) is emulate


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5"])
def test_compile_reports_without_warning(tiny_model, caplog, family):
    """Compiling logs what it compiled (Qwen3.5: its layers around eager Gated DeltaNet mixers) and warns about
    nothing."""
    model = packed_model(tiny_model, family, checkpointing=True)
    with caplog.at_level("INFO", logger=regional.log.name):
        report = regional.compile_blocks(model, backend="aot_eager")
    regional.uncompile_blocks(model)
    records = [r for r in caplog.records if r.name == regional.log.name]
    assert [r.getMessage() for r in records if r.levelname == "INFO"] == [str(report)]
    assert not [r for r in records if r.levelno >= logging.WARNING]
    assert bool(report.eager_mixers) == (family == "qwen3_5")


def test_every_recipe_compiles_with_cuda_only():
    """train.compile is auto in the schema and in every recipe: the blocks compile on CUDA (the fast path as shipped)
    and stay eager on the CPU (trainer/defaults.py)."""
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert recipes
    assert {load_config(str(path)).train.compile for path in recipes} == {"auto"}


@pytest.mark.parametrize("enabled", tiered([True, False], fast=[False]))
def test_training_run_compiles_and_logs_the_first_step_only_when_asked(tmp_path, monkeypatch, enabled):
    """train.compile=true compiles the blocks once, before accelerate wraps the model, trains, and writes the first
    step's wall and compile time to metrics.jsonl once; train.compile=false (what auto resolves to on the CPU)
    compiles nothing and writes no such record."""
    from accelerate.state import AcceleratorState

    compiled, options = [], []

    def compile_with_aot_eager(model, **kwargs):
        options.append(kwargs)
        compiled.append(regional.compile_blocks(model, backend="aot_eager", **kwargs))

    monkeypatch.setattr("trainer.setup.compile_blocks", compile_with_aot_eager)
    args = [
        "--config",
        str(ROOT / "recipes/tiny-qwen2_5_vl.yaml"),
        f"train.output_dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.num_samples=16",
        "packing.max_tokens=256",
        "kernels.mrope=unfused",
        "train.max_steps=2",
        "train.warmup_steps=1",
        f"train.compile={str(enabled).lower()}",
        "checkpoint.save_final=false",
        "checkpoint.export=false",
        "logging.report_to=none",
        "logging.progress_bar=false",
        "logging.every_steps=1",
        "logging.timing_warmup_steps=0",
    ]
    try:
        train.main(args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    records = read_metrics(tmp_path / "run")
    first = [r for r in records if "first_step_s" in r]
    assert len([r for r in records if "loss" in r]) == 2
    if enabled:
        assert len(compiled) == 1 and compiled[0].fullgraph
        assert options == [{}]
        assert len(first) == 1 and first[0]["step"] == 1 and first[0]["first_step_s"] > 0
    else:
        assert compiled == first == []


def _segments(cu_seqlens: torch.Tensor) -> list[int]:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()


def _varlen_attn_on_cpu(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, *_, **kw):
    """CPU stand-in for torch's CUDA-only varlen kernel: one SDPA per segment. (T,H,D) → out, lse, rng state."""
    gqa = query.shape[1] != key.shape[1]
    out = torch.cat(
        [
            F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                is_causal=is_causal,
                scale=scale,
                enable_gqa=gqa,
            ).transpose(0, 1)
            for q, k, v in zip(*(t.split(_segments(cu_seq_q)) for t in (query, key, value)))
        ]
    )
    lse = torch.zeros(query.shape[1], query.shape[0], dtype=torch.float32)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _varlen_attn_backward_on_cpu(
    grad_out,
    query,
    key,
    value,
    out,
    lse,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    is_causal,
    rng_state,
    scale=None,
    window_size=None,
):
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (query, key, value)]
        recomputed, _, _ = _varlen_attn_on_cpu(*inputs, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale)
        return torch.autograd.grad(recomputed, inputs, grad_out)


@pytest.fixture
def varlen_path_on_cpu(monkeypatch):
    """The CUDA attention path (torch's varlen_attn custom op, bf16 under autocast) taken on the CPU, its kernels
    replaced by per-segment SDPA stand-ins registered for this test process."""
    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", _varlen_attn_on_cpu)
    torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", _varlen_attn_backward_on_cpu)
    monkeypatch.setattr(packed, "VARLEN_DEVICES", ("cpu",))
    monkeypatch.setattr(attention_engines, "HAS_FLASH_ATTN_2", False)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("part", ["text", "vision"])
@pytest.mark.slow
def test_varlen_attention_path_is_one_graph_for_every_pack(tiny_model, tiny_samples, varlen_path_on_cpu, family, part):
    """The GPU attention path (torch.nn.attention.varlen under bf16 autocast) traces with zero graph breaks in a text
    decoder layer and a ViT block; a second pack of another length, sample count and longest sample reuses the graph
    (max_seqlen a symbolic int) and compiled equals eager."""
    model = packed_model(tiny_model, family)
    layer = (model.model.language_model.layers if part == "text" else model.model.visual.blocks)[1]
    batches = [pack_samples(model, tiny_samples(model, specs, seed=seed)) for seed, specs in enumerate(PACKS[:2])]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inputs = [_first_call_inputs(model, layer, batch) for batch in batches]
        expected = [layer(*args, **kwargs) for args, kwargs in inputs]
        explanation = torch._dynamo.explain(layer)(*inputs[0][0], **inputs[0][1])
        assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        regional.compile_blocks(model, backend=counter)
        outputs = [layer(*args, **kwargs) for args, kwargs in inputs[:1]]
        with torch._dynamo.config.patch(error_on_recompile=True):
            outputs += [layer(*args, **kwargs) for args, kwargs in inputs[1:]]
    assert compiled_graphs(counter) == 1
    for out, reference in zip(outputs, expected, strict=True):
        out, reference = (o[0] if isinstance(o, tuple) else o for o in (out, reference))
        assert (out.float() - reference.float()).abs().max() <= 1e-2 * reference.float().abs().max()


FSDP2_WORKER = """
import sys
sys.path[:0] = [{root!r}, {tests!r}]
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from conftest import _build_tiny_model, _build_tiny_samples
from test_compile import PACKS, compiled_graphs, loss_and_grads
from modeling import compile as regional, parts
from modeling.packed import enable_packed_forward
from verification.packing_check import pack_samples

dist.init_process_group("gloo")
rank = dist.get_rank()

def build():
    model = _build_tiny_model({family!r})
    enable_packed_forward(model)
    parts.enable_gradient_checkpointing(model, llm={checkpointing!r}, vision={checkpointing!r})
    return model.train()

reference, sharded = build(), build()
counter = CompileCounterWithBackend("aot_eager")
regional.compile_blocks(sharded, backend=counter)
for unit in [*sharded.model.language_model.layers, *sharded.model.visual.blocks]:
    fully_shard(unit)
fully_shard(sharded)
worst, worst_name, graphs = 0.0, "", []
for step in range(3):  # the ranks' packs differ from each other and from step to step
    batch = pack_samples(reference, _build_tiny_samples(reference, PACKS[(step + rank) % 4], seed=step + rank))
    _, expected = loss_and_grads(reference, batch)
    for grad in expected.values():
        dist.all_reduce(grad)
        grad /= 2  # FSDP averages over the 2 ranks
    _, grads = loss_and_grads(sharded, batch)
    for name, grad in grads.items():
        error = (grad.full_tensor() - expected[name]).abs().max() / expected[name].abs().max().clamp(min=1e-12)
        if error.item() > worst:
            worst, worst_name = error.item(), name
    graphs.append(compiled_graphs(counter))
print(f"RESULT rank={{rank}} worst={{worst}} graphs={{graphs}} in={{worst_name}}", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "checkpointing"),
    [("qwen2_5_vl", False), ("qwen2_5_vl", True), ("qwen2_5_vl", 1), ("qwen3_5", True)],
    ids=str,
)
def test_compiled_blocks_under_fsdp2_match_one_unsharded_model(tmp_path, family, checkpointing):
    """Compiled blocks sharded with FSDP2 (gloo, 2 ranks, packs of different shapes per rank and step), with
    gradient checkpointing replaying them and, for Qwen3.5, around its eager Gated DeltaNet mixers (the shipped
    recipes' path under FSDP2): gradients equal one unsharded eager model's, and steps after the first compile
    nothing new (FSDP2's parameters trace with symbolic shapes)."""
    worker, log = tmp_path / "worker.py", tmp_path / "fsdp2.log"
    tests = Path(__file__).parent
    source = FSDP2_WORKER.format(root=str(ROOT), tests=str(tests), family=family, checkpointing=checkpointing)
    worker.write_text(source + WORKER_EXIT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    outcome = run_logged(command, log, 600, env=env, new_session=True)
    output = log.read_text()
    assert outcome.code == 0, f"compiled FSDP2 steps failed or hung (exit {outcome.code}):\n{output[-3000:]}"
    results = re.findall(r"RESULT rank=(\d) worst=(\S+) graphs=(\[[\d, ]*\])", output)
    assert sorted(rank for rank, _, _ in results) == ["0", "1"]
    # Qwen3.5: its layers' compiled parts around the eager mixer add the gates' terms in another order than eager,
    # and the gradient of A_log, one sum over every token of terms that cancel, carries that most (relative to its max)
    tolerance = 1e-4 if family == "qwen3_5" else 1e-5
    for _, worst, graphs in results:
        assert float(worst) < tolerance
        first, *later = json.loads(graphs)
        assert first > 0 and all(g == first for g in later)


Numbers = tuple[torch.Tensor, dict[str, torch.Tensor]]  # a layer's output and every gradient ("input": the input's)


def qwen2_decoder_layer(hidden: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A random Qwen2 decoder layer (the text layer of Qwen2.5-VL: RMSNorm, GQA attention with biases, SwiGLU) of
    width `hidden`, 64-wide heads, and its rotary embedding; norm weights near 1, matmul weights N(0, 0.02)."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    heads = hidden // 64
    config = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=hidden * 43 // 16,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    layer = Qwen2DecoderLayer(config, layer_idx=0).train()
    for name, param in layer.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(param, mean=1.0, std=0.1)
        else:
            torch.nn.init.normal_(param, std=0.02 if param.dim() > 1 else 0.1)
    return layer, Qwen2RotaryEmbedding(config)


def layer_numbers(layer, rope, inputs, out_grad, dtype: torch.dtype, backend: str | None = None) -> Numbers:
    """One forward and backward of a copy of `layer` in `dtype` (bf16 autocast unless float64), compiled with
    `backend` (as compile_blocks sets inductor up) or eager."""
    model = copy.deepcopy(layer).to(dtype)
    x = inputs.clone().to(dtype).requires_grad_()
    cos, sin = rope(x, torch.arange(x.shape[1])[None])
    forward = model
    if backend is not None:
        torch._dynamo.reset()
        forward = torch.compile(model, backend=backend, dynamic=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float64):
        out = forward(x, position_embeddings=(cos.to(dtype), sin.to(dtype)), attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    (out.to(dtype) * out_grad.to(dtype)).sum().backward()
    grads = {name: p.grad.double() for name, p in model.named_parameters()}
    return out.detach().double(), {**grads, "input": x.grad.double()}


def relative_errors(numbers: Numbers, reference: Numbers) -> tuple[float, list[float]]:
    """(the output's relative error, every gradient's) of `numbers` against `reference`."""

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    return error(numbers[0], reference[0]), [error(numbers[1][n], reference[1][n]) for n in reference[1]]


@pytest.mark.slow
def test_a_compiled_decoder_layer_is_as_accurate_as_eager():
    """Tracing (aot_eager) changes no number; inductor, set up as compile_blocks sets it (eager's roundings, the
    norms' row reductions on aten), is as far from float64 as eager is, its output equals eager's bit for bit, and so
    does every gradient but the norm weights' (their sums over tokens stay inductor's: last bits). Width 512 and 256
    tokens: narrower, or fewer tokens, and inductor's CPU reductions happen to add in eager's order anyway."""
    layer, rope = qwen2_decoder_layer(hidden=512)
    generator = torch.Generator().manual_seed(1)
    inputs, out_grad = torch.randn(2, 1, 256, 512, generator=generator).unbind()
    reference = layer_numbers(layer, rope, inputs, out_grad, torch.float64)
    eager = layer_numbers(layer, rope, inputs, out_grad, torch.float32)
    traced = layer_numbers(layer, rope, inputs, out_grad, torch.float32, "aot_eager")
    assert torch.equal(traced[0], eager[0]) and all(torch.equal(traced[1][n], g) for n, g in eager[1].items())
    undo = lower_norm_reductions()
    try:
        with torch._inductor.config.patch(regional.INDUCTOR_SETTINGS):
            compiled = layer_numbers(layer, rope, inputs, out_grad, torch.float32, "inductor")
    finally:
        undo()
    eager_out64, eager_grads64 = relative_errors(eager, reference)
    out64, grads64 = relative_errors(compiled, reference)
    assert out64 <= 1.1 * eager_out64 and max(grads64) <= 1.1 * max(eager_grads64)
    norm_weights = {"input_layernorm.weight", "post_attention_layernorm.weight"}
    assert torch.equal(compiled[0], eager[0])
    assert {name for name, grad in compiled[1].items() if not torch.equal(grad, eager[1][name])} <= norm_weights
    assert max(relative_errors(compiled, eager)[1]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_aten_reductions_make_a_compiled_layer_norm_eager(input_dtype):
    """The ViT blocks of Qwen2-VL, Qwen3-VL and Qwen3.5 norm with nn.LayerNorm, which inductor decomposes into
    reductions of its own: a norm and a biased linear as in those blocks (Qwen3-VL's width, bf16 autocast, fp32
    weights; fp32 inputs, and bf16 inputs as CPU autocast leaves them) compile to other numbers than eager's with
    inductor's own reductions (checked, so the test cannot pass vacuously), and to eager's forward and all but
    eager's gradients with the norms' reductions on aten."""
    torch.manual_seed(0)
    block = torch.nn.ModuleDict({"norm": torch.nn.LayerNorm(1152, eps=1e-6), "linear": torch.nn.Linear(1152, 1152)})
    torch.nn.init.normal_(block.norm.weight, mean=1.0, std=0.1)
    torch.nn.init.normal_(block.norm.bias, std=0.1)
    inputs, out_grad = torch.randn(2, 256, 1152).unbind()

    def numbers(forward) -> tuple[torch.Tensor, list[torch.Tensor]]:
        block.zero_grad(set_to_none=True)
        x = inputs.to(input_dtype).requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            out = forward(x)
        out.backward(out_grad.to(out.dtype))
        return out.detach(), [x.grad, *(p.grad for p in block.parameters())]

    def norm_then_linear(x: torch.Tensor) -> torch.Tensor:
        return x + block.linear(block.norm(x))

    eager = numbers(norm_then_linear)
    with torch._inductor.config.patch(regional.INDUCTOR_SETTINGS):
        torch._dynamo.reset()
        inductors_own = numbers(torch.compile(norm_then_linear, backend="inductor"))
        torch._dynamo.reset()
        undo = lower_norm_reductions()
        try:
            on_aten = numbers(torch.compile(norm_then_linear, backend="inductor"))
        finally:
            undo()
    assert not torch.equal(inductors_own[0], eager[0])
    out, grads = on_aten
    assert torch.equal(out, eager[0])
    for grad, expected in zip(grads, eager[1]):
        assert ((grad.float() - expected.float()).norm() / expected.float().norm()) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5", "qwen2_5_vl"])
def test_inductor_compiled_model_trains_as_eager(tiny_model, tiny_samples, family):
    """The whole tiny model, every block compiled by inductor, under bf16 autocast as training runs it: loss and
    every gradient finite and as close to eager's as bf16 allows. (CPU autocast hands the ViT's layer norms bf16
    inputs with fp32 weights: a layer norm whose forward were aten's and backward inductor's would read aten's fp32
    statistics as bf16 and give NaN gradients to every ViT parameter.) Qwen2-VL's and Qwen3.5's ViT blocks norm with
    nn.LayerNorm; Qwen3.5's decoder layers compile around eager Gated DeltaNet mixers."""
    eager = packed_model(tiny_model, family)
    compiled = packed_model(tiny_model, family)
    regional.compile_blocks(compiled, backend="inductor")
    batch = pack_samples(eager, tiny_samples(eager, PACKS[0], seed=0))
    try:
        with torch.autocast("cpu", torch.bfloat16):
            loss, grads = loss_and_grads(compiled, batch)
            expected_loss, expected_grads = loss_and_grads(eager, batch)
    finally:
        regional.uncompile_blocks(compiled)
    assert abs(loss.item() - expected_loss.item()) <= 1e-3 * abs(expected_loss.item())
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        error = (grad - expected_grads[name]).norm() / expected_grads[name].norm().clamp_min(1e-12)
        # bf16 matmuls compiled or not round apart: up to a few percent on small gradients here
        assert error < 5e-2, f"{name}: relative error {error:.3g}"
