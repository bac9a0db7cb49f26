"""Per-GPU memory of a training run, estimated on the CPU before anything is allocated: the recipe's model is built on
the meta device (no memory, no download) and its parameters, parts and blocks are read from it.

`estimate_memory(cfg, num_processes, sharding, on_cuda)` returns a `MemoryEstimate`: a breakdown in GiB and its total.
How each part is counted (bytes per parameter; T tokens and P ViT patches per pack and rank):

    weights        what the module holds. Full fine-tune, one process or DDP (replicated): `train.master_weights`
                   module: 4 (fp32), plus 2 for autocast's bf16 copy of every trained matmul weight
                   (`cast_param_ids`), in autocast's cache to the end of the forward, then kept by the blocks that are
                   not checkpointed to their backward; optimizer: 2 per matmul weight (its fp32 master is the next
                   part), 4 per parameter kept fp32 (embeddings, lm_head, norms, gates, the ViT's patch embedding:
                   modeling/master_weights.py). LoRA (modeling/lora.py): the frozen matmul
                   weights and an untied frozen lm_head in model.dtype (2), the rest fp32 (4), the adapters fp32.
                   FSDP2 over N: each rank's shard, 4/N (LoRA's frozen cast weights 2/N).
    masters        train.master_weights=optimizer: 4 per trainable matmul weight (its fp32 copy in AdamW)
    gradients      4 per trainable parameter (fp32: the masters' or the fp32 parameters'); /N under FSDP2; counted
                   where they are alive at the peak (below)
    optimizer      AdamW's two fp32 moments: 8 per trainable parameter; /N under FSDP2
    fsdp buffers   FSDP2 only: the root unit (everything outside the decoder layers and ViT blocks: embeddings,
                   lm_head, patch embedding, merger) gathered in bf16 for the whole step, two block units gathered
                   at a time (the one computing and the one prefetched), and the largest unit's unsharded gradient
                   (bf16) with its fp32 copy for the reduce-scatter
    activations    what autograd keeps between forward and backward, per decoder layer (T tokens) and ViT block (P
                   patches), from the block's own modules (`block_activation_bytes`): the bf16 inputs of its matmuls,
                   the outputs that the next op keeps (attention's q/k/v, the MLP's gate and up), the fp32 norm
                   tensors, routed experts' copies (top-k of them per token); fewer when compiled (inductor recomputes
                   the elementwise ops). A checkpointed block keeps only its input (4 x width per token in the LLM,
                   whose residual stream is fp32; the ViT's is in model.dtype unless an fp32 position embedding is
                   added) and, while one block recomputes in the backward, `checkpoint_working_blocks` blocks' worth. A
                   part with nothing trainable before it keeps nothing (a frozen ViT and merger run forward only).
                   A block's count is scaled by its family's `activation_scale` for its part and mode (eager or
                   compiled blocks, `train.compile`), 1.0 unless the calibration sets one.
    loss           trainer/loss.py: one chunk of logits (bf16 on CUDA, fp32 on the CPU), the lm_head's gradient held
                   from forward to backward (in its own dtype), its bf16 copy, the hidden states' fp32 gradient (T rows)
    compile        COMPILE_WORKSPACE_GIB with train.compile (inductor's workspace), else 0
    allocator      ALLOCATOR_MARGIN of everything above: the caching allocator's blocks that cannot be reused
    runtime        the CUDA context, cuBLAS/NCCL workspaces (not seen by torch.cuda.max_memory_allocated), GPU only

The peak is the largest of four moments of a step (`optimizer.zero_grad(set_to_none=True)` frees the gradients
between steps): the end of the forward (every activation, module mode's copies, the loss's stored gradients;
gradients only from earlier micro-steps, or under DDP, whose buckets hold them from the start), the LLM's
checkpointed layers recomputing (the layers after them done: their activations and module mode's copies freed, their
gradients written, in proportion), the ViT's backward (the LLM's gradients, the ViT's activations, or its inputs and
the recompute of its checkpointed blocks) and the end of the backward (every gradient). The breakdown is the one at
the peak. The checkpointed blocks are the first of each stack (modeling/parts.py): their backward runs last.

`MemoryEstimate.peak_gib` (weights through compile) is what `torch.cuda.max_memory_allocated` reports (a run's
`peak_mem_gib`), the quantity scripts/estimate_memory.py --compare checks against measured peaks; `total_gib` adds
the allocator and runtime margins and is what must fit the device.

T is `packing.max_tokens` / `parallel.context` (packed; `padded_batch_size` x max_tokens padded). P is T x merge² x
the vision share of a pack: an image of `data.max_pixels` (a mixture's largest) is `max_pixels / (patch x merge)²`
LLM tokens, and a sample carries TEXT_TOKENS_PER_IMAGE text tokens beside it; with max_pixels null (the data's own
sizes) a pack may be all image tokens, share 1. A 16k-token pack of 256-1024-token images: ~59k patches (the
built-in data measure ~56k).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from core.config import Config, ModelConfig
from core.data_config import source_data_config
from core.families import hf_config, model_class
from modeling import parts
from modeling.master_weights import auto_mode, cast_param_ids
from trainer.loss import CE_CHUNK_ELEMENTS, CE_KERNEL_CHUNK_ELEMENTS

GIB = 2**30
Sharding = Literal["none", "ddp", "fsdp2"]
MARGIN_PARTS = ("allocator", "runtime")  # the parts beyond the allocated peak

CALIBRATION_FILE = Path(__file__).with_name("memory_calibration.json")
"""The calibration, as data: `estimate` holds `checkpoint_working_blocks` (per part, "llm" or "vision": the blocks'
worth of activations alive while a checkpointed block recomputes) and `activation_scale` (model_type -> "eager" or
"compiled" -> part -> measured / counted activations; `activation_scale_default` elsewhere), each with the
measurements that set it; `points` the measured peaks (recipe, overrides, launch, GPU, date, commit) that
tests/test_memory_calibration.py holds within `target` of the estimate (docs/memory.md, "Calibration")."""
CALIBRATION = json.loads(CALIBRATION_FILE.read_text())["estimate"]
COMPILE_WORKSPACE_GIB = 0.5
"""Inductor's workspace and the compiled blocks' extra buffers with train.compile: an allowance not measured apart
yet; the compiled peaks of docs/memory.md's calibration fit with it."""
ALLOCATOR_MARGIN = 0.05
"""The share of the allocated peak that the caching allocator holds beyond it (blocks split or cached that a request
cannot reuse): the OOM of recipe-qwen2_5_vl-3b-vit-uncheckpointed-oom-h200-2026-12-05.json reports 0.46 GiB
reserved-but-unallocated at 138.6 GiB allocated; 5% leaves room for other packs' shapes."""
CUDA_RUNTIME_GIB = 1.0
"""The CUDA context, cuBLAS and NCCL workspaces and the Triton kernels' modules: outside torch's allocator (that OOM:
139.77 GiB in use by the process against 139.06 reserved by PyTorch, 0.7 GiB)."""
TEXT_TOKENS_PER_IMAGE = 112
"""Text tokens (prompt and answer) per image sample, for the vision share of a pack: the built-in data's packs of
256-1024-token images are ~85% image tokens (recipes/bench-qwen2_5_vl-3b-shape.yaml), ~112 text tokens a sample.
recipes/qwen2_5_vl-3b.yaml's data hold 58,925 ViT patches per pack on average (scripts/inspect_data.py,
data.num_samples=400), the estimate 59,074."""
RESIDUAL_PROJECTIONS = ("o_proj", "out_proj", "down_proj", "proj", "linear_fc2")
"""Linear layers whose output goes straight into the residual add (which keeps nothing for its backward)."""
ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj", "qkv", "in_proj_qkv")
"""Linear layers whose output is kept twice: by the rope or conv that follows, and (rotated) by the attention kernel."""


@dataclass(frozen=True)
class MemoryEstimate:
    """The per-GPU (or, on the CPU, per-process) memory of one training run, in GiB, part by part (module docstring).

    `parts` maps each part's name to GiB, in the order the module docstring lists them; `peak_gib` is their sum
    before the allocator and runtime margins (what torch.cuda.max_memory_allocated measures), `total_gib` all of
    them. The other fields say what was assumed."""

    parts: dict[str, float]
    num_processes: int
    sharding: Sharding
    master_weights: str  # the mode the estimate assumed: "module" or "optimizer" (or "fsdp2" mixed precision)
    compiled: bool
    tokens_per_pack: int  # LLM tokens per pack and rank
    vision_patches_per_pack: int  # ViT patches per pack and rank
    total_params: int
    trainable_params: int
    on_cuda: bool = True

    @property
    def total_gib(self) -> float:
        return sum(self.parts.values())

    @property
    def peak_gib(self) -> float:
        """The allocated peak: every part but the allocator and runtime margins."""
        return sum(gib for name, gib in self.parts.items() if name not in MARGIN_PARTS)

    def fits(self, capacity_gib: float) -> bool:
        return self.total_gib <= capacity_gib

    def describe(self) -> str:
        """One line: the total, the launch assumed and the parts of at least 1% of it (3 significant digits)."""
        launch = "1 process" if self.num_processes == 1 else f"{self.sharding.upper()} over {self.num_processes}"
        shown = ", ".join(f"{name} {gib:.3g}" for name, gib in self.parts.items() if gib >= 0.01 * self.total_gib)
        return f"~{self.total_gib:.3g} GiB per {'GPU' if self.on_cuda else 'process'} ({launch}; GiB: {shown})"

    def lines(self) -> list[str]:
        """The report: one line per part, then the peak and the total."""
        launch = "one process" if self.num_processes == 1 else f"{self.sharding.upper()} over {self.num_processes}"
        header = (
            f"memory estimate per {'GPU' if self.on_cuda else 'process'} ({launch}; master weights: "
            f"{self.master_weights}; {'compiled' if self.compiled else 'eager'} blocks; {self.tokens_per_pack} tokens "
            f"and {self.vision_patches_per_pack} ViT patches per pack; {_count(self.trainable_params)} of "
            f"{_count(self.total_params)} parameters trained)"
        )
        rows = [f"  {name:<20} {gib:8.2f} GiB" for name, gib in self.parts.items()]
        rows.append(f"  {'peak (allocated)':<20} {self.peak_gib:8.2f} GiB")
        rows.append(f"  {'total (with margins)':<20} {self.total_gib:8.2f} GiB")
        return [header, *rows]


def _count(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 10**8 else f"{params / 1e6:.2f}M"


@dataclass(frozen=True)
class _Param:
    """One parameter (a tied one once) as the estimate sees it."""

    numel: int
    trainable: bool
    cast: bool  # a matmul weight (`cast_param_ids`): computed in model.dtype
    lora_frozen_cast: bool  # LoRA holds it frozen in model.dtype
    part: str = "llm"  # "llm", "vision" or "merger" (parts.part_modules); an adapter counts as the LLM's


def meta_model(model_cfg: ModelConfig) -> nn.Module:
    """The recipe's model on the meta device, as trainer/setup.py builds it (fp32, before casts): shapes only. A
    checkpoint (`model.name_or_path`) contributes its config; no weight is read."""
    config = hf_config(model_cfg)
    with torch.device("meta"):
        return model_class(config)._from_config(config, dtype=torch.float32)


def resolved_master_weights(cfg: Config, num_processes: int, sharding: Sharding, on_cuda: bool) -> str:
    """The master-weight mode the launch computes with: `train.master_weights` with `auto` resolved as
    trainer/defaults.py resolves it, "fsdp2" under FSDP2 (its mixed precision: fp32 shards, bf16 gathers), and
    "module" where the key has no effect (float32 weights)."""
    if sharding == "fsdp2" and num_processes > 1:
        return "fsdp2"
    mode = cfg.train.master_weights
    if mode == "auto":
        mode, _ = auto_mode(cfg.model.dtype, sharding == "fsdp2", num_processes, on_cuda)
    return "module" if cfg.model.dtype == "float32" else mode


def _dtype_bytes(dtype: str) -> int:
    return torch.finfo(getattr(torch, dtype)).bits // 8


def _trainable_ids(model: nn.Module, cfg: Config) -> set[int]:
    """ids of the parameters that train: the unfrozen parts, or under LoRA the parts of `lora.trainable`."""
    if cfg.lora is None:
        frozen = {"vision": cfg.model.freeze_vision, "merger": cfg.model.freeze_merger, "llm": cfg.model.freeze_llm}
        modules = [m for part, mods in parts.part_modules(model).items() if not frozen[part] for m in mods]
        return {id(p) for m in modules for p in m.parameters()}
    from modeling.lora import trained_modules

    modules = [model.get_submodule(name) for name in trained_modules(model, cfg.lora.trainable)]
    return {id(p) for m in modules for p in m.parameters()}


def _lora_targets(model: nn.Module, cfg: Config) -> list[nn.Linear]:
    from modeling.lora import target_modules

    return [model.get_submodule(name) for name in target_modules(model, cfg.lora)] if cfg.lora is not None else []


def _params(model: nn.Module, cfg: Config) -> list[_Param]:
    cast_ids = cast_param_ids(model)
    trainable = _trainable_ids(model, cfg)
    lora_cast = set()
    if cfg.lora is not None and cfg.model.dtype != "float32":
        lora_cast = set(cast_ids)
        if model.lm_head.weight is not model.get_input_embeddings().weight:
            lora_cast.add(id(model.lm_head.weight))
    part_of = {id(p): part for part, mods in parts.part_modules(model).items() for m in mods for p in m.parameters()}
    return [
        _Param(
            p.numel(),
            id(p) in trainable,
            id(p) in cast_ids,
            id(p) in lora_cast and id(p) not in trainable,
            part_of.get(id(p), "llm"),
        )
        for p in model.parameters()
    ]


def _adapters(targets: list[nn.Linear], rank: int) -> list[_Param]:
    """LoRA's A (r, in) and B (out, r) of every target: fp32, trained, cast at use like any matmul weight."""
    return [_Param(rank * (m.in_features + m.out_features), True, True, False) for m in targets]


def _state_bytes(params: list[_Param], mode: str, dtype_bytes: int, shards: int) -> dict[str, float]:
    """weights, masters, gradients and optimizer (bytes per rank) for `mode` (module docstring): "fsdp2" holds fp32
    shards with no autocast copy (its bf16 gathers are `_fsdp_buffers`). Module mode's autocast copies of trained
    matmul weights are apart, by part (`copies_llm`, `copies_vision`, `copies_merger`): the estimate places them."""
    states = dict.fromkeys(("weights", "masters", "gradients", "optimizer", "copies_llm", "copies_vision"), 0.0)
    states["copies_merger"] = 0.0
    half = dtype_bytes < 4
    for p in params:
        if p.lora_frozen_cast:
            states["weights"] += dtype_bytes * p.numel
            continue
        if mode == "optimizer" and p.cast and half:
            states["weights"] += dtype_bytes * p.numel
            states["masters"] += 4 * p.numel if p.trainable else 0
        else:
            states["weights"] += 4 * p.numel
            if mode == "module" and p.cast and half and p.trainable:  # autocast caches the casts of trained leaves
                states[f"copies_{p.part}"] += dtype_bytes * p.numel
        if p.trainable:
            states["gradients"] += 4 * p.numel
            states["optimizer"] += 8 * p.numel
    return {name: value / shards for name, value in states.items()}


def _linears(block: nn.Module) -> Iterator[tuple[str, str, nn.Linear]]:
    """(parent path, leaf name, layer) of every nn.Linear in `block`, a LoRA layer's base layer standing for it."""
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith(("lora_A.default", "lora_B.default")):
            parent, _, leaf = name.rpartition(".")
            if leaf == "base_layer":
                parent, _, leaf = parent.rpartition(".")
            yield parent, leaf, module


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("RMSNorm", "RMSNormGated"))


def _norm_width(block: nn.Module, name: str, module: nn.Module, width: int) -> int:
    """The width a norm normalises per token: a per-head norm (q_norm, k_norm, a gated norm) covers its projection's
    output; any other, its weight's width."""
    parent = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
    leaf = name.rpartition(".")[2]
    for prefix, proj in (("q_", "q_proj"), ("k_", "k_proj")):
        if leaf.startswith(prefix) and hasattr(parent, proj):
            return _base(getattr(parent, proj)).out_features
    out = getattr(parent, "out_proj", None)
    if leaf == "norm" and out is not None and parent is not block:
        return _base(out).in_features
    weight = getattr(module, "weight", None)
    return weight.numel() if weight is not None else width


def _base(layer: nn.Module) -> nn.Linear:
    return getattr(layer, "base_layer", layer)


def block_activation_bytes(
    block: nn.Module,
    width: int,
    top_k: int = 0,
    expert_bytes: int = 2,
    compiled: bool = False,
    trained: bool = True,
    adapted: frozenset[int] = frozenset(),
) -> int:
    """Bytes autograd keeps per token for one pass of `block` (a decoder layer or ViT block of residual width
    `width`) with its matmuls in a 16-bit dtype:

    - 2 x in_features for each distinct matmul input (layers of one parent with one input width share it, but for
      a RESIDUAL_PROJECTIONS layer, whose input is its own), kept for the weight's gradient: only when the block's
      weights train (`trained`). Under LoRA (`adapted`: ids of the nn.Linear layers with an adapter) each adapter
      keeps its own bf16 cast of an fp32 input (q, k and v three of them), one for an input already in bf16
    - 2 x out_features for each matmul output the next op keeps (all but RESIDUAL_PROJECTIONS), once more for
      ATTENTION_INPUTS (the rotated q/k/v the attention kernel keeps)
    - eager only: 2 x out_features once more for a gated MLP's gate (the activation's output, kept by the product;
      a compiled block recomputes it)
    - per norm (`_norm_width`): an eager RMSNorm 8 x width (its fp32 input and normalised output); compiled, or an
      nn.LayerNorm (one aten kernel), 4 x width (the fp32 input; the rest is recomputed)
    - 4 x channels for each depthwise Conv1d (Gated DeltaNet: its input and output)
    - routed experts (a module holding a 3-D `gate_up_proj`): top_k x (2 x width + 4 x expert width) elements of
      `expert_bytes` each: each copy of the token, its gate/up output, the activation, the down projection's input
      and output (the expert stacks multiply in their own dtype: autocast does not cast grouped_mm)
    """
    total = 0
    inputs: dict[tuple[str, int, bool], int] = {}  # (parent, in_features, residual) -> layers with an adapter
    for parent, leaf, layer in _linears(block):
        residual = leaf in RESIDUAL_PROJECTIONS  # its input is the output of what precedes it, its own tensor
        key = (parent, layer.in_features, residual)
        inputs[key] = inputs.get(key, 0) + (id(layer) in adapted)
        if not residual:
            total += 2 * layer.out_features
        if leaf in ATTENTION_INPUTS or (leaf == "gate_proj" and not compiled):
            total += 2 * layer.out_features
    for (_, in_features, residual), adapters in inputs.items():
        copies = 1 if trained or (residual and adapters) else adapters
        total += 2 * in_features * copies
    for name, module in block.named_modules():
        if _is_norm(module):
            fused = compiled or isinstance(module, nn.LayerNorm)  # aten's layer norm keeps its fp32 input only
            total += (4 if fused else 8) * _norm_width(block, name, module, width)
        elif isinstance(module, nn.Conv1d):
            total += 4 * module.in_channels
        gate_up = getattr(module, "gate_up_proj", None)
        if isinstance(gate_up, nn.Parameter) and gate_up.ndim == 3:
            expert_width = gate_up.shape[1] // 2 if gate_up.shape[2] == width else gate_up.shape[2] // 2
            total += top_k * (2 * width + 4 * expert_width) * expert_bytes
    return total


def stack_blocks(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """(decoder layers, ViT blocks)."""
    inner = parts.inner_model(model)
    return list(inner.language_model.layers), list(inner.visual.blocks)


def largest_max_pixels(data_cfg) -> int | None:
    """The largest image bound any source resizes to (a mixture's sources may set their own max_pixels); None when
    one keeps the data's own sizes."""
    sources = [source_data_config(data_cfg, source) for source in data_cfg.sources or ()] or [data_cfg]
    bounds = [source.max_pixels for source in sources]
    return None if None in bounds else max(bounds)


def vision_patches_per_pack(cfg: Config, tokens: int, vision_config) -> int:
    """ViT patches in a pack of `tokens` LLM tokens (module docstring): tokens x merge² x the vision share."""
    merge = vision_config.spatial_merge_size
    max_pixels = largest_max_pixels(cfg.data)
    if max_pixels is None:
        share = 1.0
    else:
        image_tokens = max(1.0, max_pixels / (vision_config.patch_size * merge) ** 2)
        share = image_tokens / (image_tokens + TEXT_TOKENS_PER_IMAGE)
    return int(tokens * share * merge**2)


def tokens_per_pack(cfg: Config) -> int:
    if cfg.packing.mode == "padded":
        return cfg.packing.padded_batch_size * cfg.packing.max_tokens
    return -(-cfg.packing.max_tokens // cfg.parallel.context)


@dataclass(frozen=True)
class _Activations:
    """Bytes of one stack of blocks: what stays from the forward to the backward (`kept`), and what is alive while
    its checkpointed blocks recompute in the backward (`recompute`: their inputs and `checkpoint_working_blocks`
    blocks' worth; the blocks after them, whose backward runs first, have freed theirs). Scaled by the calibration's
    activation scale, but for the inputs (their size is exact)."""

    kept: float = 0.0
    recompute: float = 0.0


def activation_scale(family: str, compiled: bool, part: str) -> float:
    """The calibration's measured / counted activations of `family`'s `part` ("llm" or "vision"), eager or compiled."""
    scales = CALIBRATION["activation_scale"].get(family, {}).get("compiled" if compiled else "eager", {})
    return scales.get(part, CALIBRATION["activation_scale_default"])


def _stack_activations(
    blocks: list[nn.Module],
    part: str,
    width: int,
    count: int,
    checkpointed: int,
    residual_bytes: int,
    scale: float,
    **kwargs,
) -> _Activations:
    """A stack of blocks of `part` ("llm" or "vision") over `count` tokens whose first `checkpointed` blocks
    recompute: those keep their input (`residual_bytes` x width per token), the others every activation (their count
    times `scale`)."""
    if not blocks or count == 0:
        return _Activations()
    per_block = [scale * block_activation_bytes(b, width, **kwargs) for b in blocks]
    inputs = count * residual_bytes * width * checkpointed
    kept = inputs + count * float(sum(per_block[checkpointed:]))
    if not checkpointed:
        return _Activations(kept)
    working = CALIBRATION["checkpoint_working_blocks"][part] * max(per_block[:checkpointed])
    return _Activations(kept, inputs + count * working)


def _activations(
    model: nn.Module,
    cfg: Config,
    tokens: int,
    patches: int,
    compiled: bool,
    adapted: frozenset[int],
    expert_bytes: int,
    checkpointed: tuple[int, int],
) -> tuple[_Activations, _Activations]:
    """(the LLM's, the ViT's and merger's) activations for a pack of `tokens` tokens and `patches` ViT patches;
    `adapted`: ids of the linear layers with a LoRA adapter; `checkpointed`: the (decoder layers, ViT
    blocks) that recompute, the first ones of each stack."""
    layers, blocks = stack_blocks(model)
    text, vision = model.config.text_config, model.config.vision_config
    vit_width = getattr(vision, "embed_dim", None) or vision.hidden_size  # Qwen2-VL's hidden_size is the LLM's
    trains = _parts_training(cfg)
    scales = {part: activation_scale(model.config.model_type, compiled, part) for part in ("llm", "vision")}
    lora_on = {part: cfg.lora is not None and getattr(cfg.lora, part) for part in ("vision", "merger")}
    llm = _stack_activations(
        layers,
        "llm",
        text.hidden_size,
        tokens,
        checkpointed[0],
        residual_bytes=4,  # the input embeddings stay fp32, so the residual stream does
        scale=scales["llm"],
        top_k=getattr(text, "num_experts_per_tok", 0) or 0,
        expert_bytes=expert_bytes,  # fp32 expert stacks (module mode, full fine-tune) multiply in fp32
        compiled=compiled,
        trained=trains["llm"],
        adapted=adapted,
    )
    vit = _Activations()
    vision_keeps = trains["vision"] or lora_on["vision"]
    # the patch embedding's output is in the compute dtype, unless an fp32 position embedding is added to it
    fp32_positions = hasattr(parts.inner_model(model).visual, "pos_embed")
    if vision_keeps:
        vit = _stack_activations(
            blocks,
            "vision",
            vit_width,
            patches,
            checkpointed[1],
            residual_bytes=4 if fp32_positions else _dtype_bytes(cfg.model.dtype),
            scale=scales["vision"],
            compiled=compiled,
            trained=trains["vision"],
            adapted=adapted,
        )
    if vision_keeps or trains["merger"] or lora_on["merger"]:
        merged = patches // vision.spatial_merge_size**2  # a merger's matmuls run on merged tokens
        units = [unit for m in parts.merger_parts(model) for unit in _units(m)]
        merger_bytes = (
            merged
            * scales["vision"]
            * sum(
                block_activation_bytes(u, vit_width, compiled=compiled, trained=trains["merger"], adapted=adapted)
                for u in units
            )
        )
        vit = _Activations(vit.kept + merger_bytes, vit.recompute)  # the merger's backward runs before the ViT's
    return llm, vit


def _loss_bytes(model: nn.Module, tokens: int, on_cuda: bool, lm_head_trainable: bool, weight_bytes: int) -> float:
    vocab, hidden = model.lm_head.weight.shape
    chunk = CE_KERNEL_CHUNK_ELEMENTS if on_cuda else CE_CHUNK_ELEMENTS
    logits = min(tokens * vocab, chunk) * (2 if on_cuda else 4)
    weight_copy = 2 * vocab * hidden if weight_bytes == 4 else 0
    weight_grad = weight_bytes * vocab * hidden if lm_head_trainable else 0
    return logits + weight_copy + weight_grad + 4 * tokens * hidden


def _fsdp_buffers(model: nn.Module, params_by_id: dict[int, _Param]) -> float:
    """Bytes FSDP2 holds beyond the shards (module docstring)."""
    layers, blocks = stack_blocks(model)
    unit_ids = {id(p) for unit in layers + blocks for p in unit.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in unit_ids)
    largest = max((sum(p.numel() for p in unit.parameters()) for unit in layers + blocks), default=0)
    largest_trainable = max(
        (sum(p.numel() for p in u.parameters() if params_by_id[id(p)].trainable) for u in layers + blocks), default=0
    )
    return 2 * root + 2 * 2 * largest + (2 + 4) * largest_trainable


def estimate_memory(
    cfg: Config,
    num_processes: int = 1,
    sharding: Sharding | None = None,
    on_cuda: bool = True,
    vision_patches: int | None = None,
    model: nn.Module | None = None,
) -> MemoryEstimate:
    """The per-GPU memory of training `cfg` on `num_processes` processes (module docstring for the derivation).

    sharding: "fsdp2" (parameters, gradients and optimizer states sharded over the processes), "ddp" (replicated)
    or "none" (one process); None: "none" for one process, else "fsdp2". on_cuda: the launch's device (CUDA: bf16
    logits chunks and the runtime margin; `auto` settings resolve as they would there). vision_patches: ViT patches
    per pack when known (scripts/inspect_data.py measures them), else from data.max_pixels. model: the recipe's
    model on the meta device when the caller has it (`meta_model`), else it is built."""
    sharding = sharding or ("none" if num_processes == 1 else "fsdp2")
    if sharding == "none" and num_processes != 1:
        raise ValueError(f"sharding='none' is one process, got num_processes={num_processes}.")
    model = model if model is not None else meta_model(cfg.model)
    mode = resolved_master_weights(cfg, num_processes, sharding, on_cuda)
    compiled = cfg.train.compile is True or (cfg.train.compile == "auto" and on_cuda)
    shards = num_processes if sharding == "fsdp2" else 1
    dtype_bytes = _dtype_bytes(cfg.model.dtype)

    targets = _lora_targets(model, cfg)
    base = _params(model, cfg)
    params = base + _adapters(targets, cfg.lora.rank if cfg.lora else 0)
    states = _state_bytes(params, mode, dtype_bytes, shards)

    tokens = tokens_per_pack(cfg)
    vision = model.config.vision_config
    patches = vision_patches if vision_patches is not None else vision_patches_per_pack(cfg, tokens, vision)
    expert_bytes = 4 if mode == "module" and cfg.lora is None else dtype_bytes
    layers, blocks = stack_blocks(model)
    checkpointed = checkpointed_blocks(cfg, model)
    adapted = frozenset(id(m) for m in targets)
    llm, vit = _activations(model, cfg, tokens, patches, compiled, adapted, expert_bytes, checkpointed)
    params_by_id = {id(p): q for p, q in zip(model.parameters(), base, strict=True)}
    lm_head = params_by_id[id(model.lm_head.weight)]
    lm_head_bytes = 2 if mode == "fsdp2" or lm_head.lora_frozen_cast else 4
    loss = _loss_bytes(model, tokens, on_cuda, lm_head.trainable, lm_head_bytes)
    fsdp = _fsdp_buffers(model, params_by_id) if mode == "fsdp2" else 0.0
    llm_ids = {id(p) for m in parts.llm_parts(model) for p in m.parameters()}
    llm_trainable = sum(q.numel for i, q in params_by_id.items() if i in llm_ids and q.trainable)
    llm_grads = 4 * (llm_trainable + sum(p.numel for p in params[len(base) :])) / shards  # adapters: the LLM's
    # gradients alive before the backward: the earlier micro-steps' when accumulating, and under DDP always (the
    # gradients are views into its reduction buckets, allocated when it wraps the model: core/distributed.py)
    accumulated = states["gradients"] if cfg.train.grad_accum_steps > 1 or sharding == "ddp" else 0.0

    # module mode's autocast copies: all of them at the end of the forward (autocast's cache); in the backward only
    # those the matmuls of blocks that are not checkpointed keep (and the merger's, which is never checkpointed)
    copies = {part: states.pop(f"copies_{part}") for part in ("llm", "vision", "merger")}
    vision_held = copies["vision"] * (1 - checkpointed[1] / len(blocks)) if blocks else 0.0
    # the peak, the largest of: the end of the forward (every activation kept, every copy, the loss's stored
    # gradients), the LLM's checkpointed layers recomputing (the layers after them done: their activations and
    # copies freed, their gradients written), the ViT's backward (the LLM's gradients, the ViT's activations or its
    # checkpointed blocks recomputing) and the end of the backward (every gradient)
    upper_llm_grads = llm_grads * (1 - checkpointed[0] / len(layers))
    phases = [  # (copies, gradients, LLM activations, ViT activations, loss)
        (sum(copies.values()), accumulated, llm.kept, vit.kept, loss),
        (vision_held + copies["merger"], max(accumulated, upper_llm_grads), llm.recompute, vit.kept, loss),
        (vision_held + copies["merger"], max(accumulated, llm_grads), 0.0, max(vit.kept, vit.recompute), 0.0),
        (0.0, states["gradients"], 0.0, 0.0, 0.0),
    ]
    held_copies, grads, llm_acts, vit_acts, loss_at_peak = max(phases, key=lambda p: p[0] + p[1] + p[2] + p[3] + p[4])
    part_bytes = {
        **states,
        "weights": states["weights"] + held_copies,
        "gradients": grads,
        "fsdp_buffers": fsdp,
        "activations_llm": llm_acts,
        "activations_vision": vit_acts,
        "loss": loss_at_peak,
    }
    gib = {name: value / GIB for name, value in part_bytes.items()}
    gib["compile"] = COMPILE_WORKSPACE_GIB if compiled else 0.0
    peak = sum(gib.values())
    gib["allocator"] = ALLOCATOR_MARGIN * peak
    gib["runtime"] = CUDA_RUNTIME_GIB if on_cuda else 0.0
    return MemoryEstimate(
        parts=gib,
        num_processes=num_processes,
        sharding=sharding,
        master_weights=mode,
        compiled=compiled,
        tokens_per_pack=tokens,
        vision_patches_per_pack=patches,
        total_params=sum(p.numel for p in params),
        trainable_params=sum(p.numel for p in params if p.trainable),
        on_cuda=on_cuda,
    )


def checkpointed_blocks(cfg: Config, model: nn.Module) -> tuple[int, int]:
    """The (decoder layers, ViT blocks) that `cfg`'s concrete checkpointing settings recompute (the first ones of
    each stack); a ConfigError for a count above the model's depth or an `auto` not yet resolved
    (trainer/activation_checkpointing.py resolves it)."""
    layers, blocks = stack_blocks(model)
    llm = parts.checkpointed_count(
        cfg.model.gradient_checkpointing_llm, len(layers), "model.gradient_checkpointing_llm"
    )
    key = "model.gradient_checkpointing_vision"
    return llm, parts.checkpointed_count(cfg.model.gradient_checkpointing_vision, len(blocks), key)


def _units(module: nn.Module) -> list[nn.Module]:
    return list(module) if isinstance(module, nn.ModuleList) else [module]


def _parts_training(cfg: Config) -> dict[str, bool]:
    """Whether each part's own weights train fully (not frozen; under LoRA, listed in lora.trainable)."""
    if cfg.lora is not None:
        return {part: part in cfg.lora.trainable for part in ("vision", "merger", "llm")}
    model = cfg.model
    return {"vision": not model.freeze_vision, "merger": not model.freeze_merger, "llm": not model.freeze_llm}
