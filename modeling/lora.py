"""LoRA fine-tuning through peft: adapters injected into the HF model itself, the base frozen in the compute dtype,
checkpoints of the trained tensors only, and the export's adapter (peft's format) and merged weights.

Injection: `peft.inject_adapter_in_model` replaces each target nn.Linear by peft's LoRA Linear in place (the original
layer becomes its `base_layer`; `lora_A` (r, in) and `lora_B` (out, r) hold the adapter), so the model keeps its
class and every path the rest of the code reads (`model.model.visual`, `model.model.language_model`, `model.lm_head`,
`model.config`). A PeftModel wrapper would hide those behind `base_model.model`. Injection happens after the rope
patch and the packed forward (they replace transformers' functions and attention modules' dispatch, not linear
layers) and before gradient checkpointing, compile, the optimizer and accelerate.

What trains: the adapters, plus the parts named in `lora.trainable`, fully (plain requires_grad, so the parts and
their learning rates (trainer/optim.py) and FSDP2's units are the usual ones; peft's `modules_to_save` would train
a copy of each such module beside the frozen original). Everything else is frozen. The input embeddings' output
takes a gradient all the same (`_output_requires_grad`: FSDP2's ranks must reach the first decoder layer alike).

Memory: the frozen matmul weights (those autocast would cast at every use, modeling/master_weights.py's
`cast_param_ids`, and an untied frozen lm_head, which the loss casts) are held in `model.dtype`: 2 bytes per base
parameter in bf16 instead of 4 plus autocast's copy. Their products are unchanged: autocast rounds an fp32 weight to
those same bf16 values at every use. Embeddings, norms and gates stay fp32, as in a full fine-tune, so the residual
stream does too. The adapters and fully trained parts stay fp32 masters (module mode) or get fp32 masters in the
optimizer (`train.master_weights=optimizer`).

Checkpoints: the model's state dict holds only its trainable tensors (a state-dict hook drops the frozen ones, and a
load hook does not ask for them), so accelerate's save_state and load_state, under one process, DDP and FSDP2, write
and read the adapters, the fully trained parts and their optimizer state, never the base. A resumed run rebuilds the
base from its source (`model.name_or_path` or the seeded random init) before loading them. `full_state_dict` turns
the filter off for the export.

Export: `export_adapter` writes final/adapter/ as `PeftModel.save_pretrained` would (adapter_config.json,
adapter_model.safetensors: keys `base_model.model.<module>.lora_A.weight`, fully trained parts as peft's
`modules_to_save`), which `peft.PeftModel.from_pretrained(base, path)` loads; `merged_state` folds each adapter into
its base weight, W + scaling · B A computed in fp32, for the merged model in final/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import peft
import torch
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from torch import nn

from core.config import LoraConfig
from modeling import parts
from modeling.master_weights import cast_param_ids

log = logging.getLogger(__name__)
ADAPTER = "default"  # peft's name for a model's single adapter
ALL_LINEAR = "all-linear"
PEFT_PREFIX = "base_model.model."  # where PeftModel keeps the HF model: the saved adapter's keys start with it
ADAPTER_DIR = "adapter"  # final/adapter/
_KEEP_FROZEN = "_lora_full_state_dict"  # model attribute: the state dict keeps the frozen tensors while set


@dataclasses.dataclass(frozen=True)
class LoraReport:
    """What `apply_lora` did: module paths in the HF model."""

    targets: tuple[str, ...]  # linear layers with an adapter
    trained_modules: tuple[str, ...]  # modules trained fully (lora.trainable; peft's modules_to_save in the export)
    adapter_params: int  # parameters of the adapters
    trained_module_params: int  # parameters of the fully trained modules
    frozen_cast: int  # frozen tensors held in the compute dtype

    def __str__(self) -> str:
        return (
            f"lora: {len(self.targets)} linear layers adapted ({self.adapter_params:,} adapter parameters), "
            f"{len(self.trained_modules)} modules trained fully ({self.trained_module_params:,} parameters), "
            f"{self.frozen_cast} frozen base tensors held in the compute dtype"
        )


def _scopes(model: nn.Module, lora_cfg: LoraConfig) -> dict[str, list[nn.Module]]:
    """The parts whose linear layers may take adapters: the language model (never the lm_head), and the ViT blocks
    and the merger(s) where lora.vision / lora.merger ask for them."""
    scopes = {"language model": [parts.inner_model(model).language_model]}
    if lora_cfg.vision:
        scopes["vision tower"] = parts.vision_parts(model)
    if lora_cfg.merger:
        scopes["merger"] = parts.merger_parts(model)
    return scopes


def target_modules(model: nn.Module, lora_cfg: LoraConfig) -> list[str]:
    """Paths (in `model`) of the nn.Linear layers to adapt: every one in the enabled scopes for "all-linear", else
    those whose path is or ends with one of the given names. ValueError for a name that matches nothing, or an
    enabled scope where nothing matches, naming the layers there."""
    names = {id(module): name for name, module in model.named_modules()}
    wanted = lora_cfg.target_modules
    targets, unmatched = [], set() if wanted == ALL_LINEAR else set(wanted)
    for scope, modules in _scopes(model, lora_cfg).items():
        linear = [names[id(m)] for part in modules for m in part.modules() if isinstance(m, nn.Linear)]
        if wanted == ALL_LINEAR:
            chosen = linear
        else:
            chosen = [n for n in linear if any(n == w or n.endswith("." + w) for w in wanted)]
            unmatched -= {w for w in wanted for n in chosen if n == w or n.endswith("." + w)}
        if not chosen:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
            raise ValueError(
                f"lora.target_modules={wanted} matches no linear layer of the {scope}; its linear layers are named "
                f"{leaves}."
            )
        targets += chosen
    if unmatched:
        raise ValueError(f"lora.target_modules names {sorted(unmatched)}, which match no linear layer to adapt.")
    return targets


def trained_modules(model: nn.Module, trainable: list[str]) -> list[str]:
    """Paths of the modules `lora.trainable` trains fully: the vision tower's children with parameters (each block of
    a block list), the merger(s), the input embeddings, the lm_head."""
    names = {id(module): name for name, module in model.named_modules()}
    groups = {
        "vision": parts.vision_parts(model),
        "merger": parts.merger_parts(model),
        "embed_tokens": [model.get_input_embeddings()],
        "lm_head": [model.lm_head],
    }
    chosen = []
    for group in trainable:
        for module in groups[group]:
            units = list(module) if isinstance(module, nn.ModuleList) else [module]
            chosen += [names[id(unit)] for unit in units if next(unit.parameters(), None) is not None]
    return chosen


def peft_config(lora_cfg: LoraConfig, targets: list[str], base_model: str | None = None) -> peft.LoraConfig:
    """The peft config of these adapters (targets as exact module paths)."""
    return peft.LoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.scaling_alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=targets,
        use_rslora=lora_cfg.use_rslora,
        bias="none",
        base_model_name_or_path=base_model,
    )


def apply_lora(model: nn.Module, lora_cfg: LoraConfig, compute_dtype: torch.dtype) -> LoraReport:
    """Adapt `model` in place (module docstring): inject the adapters, freeze everything but them and the modules of
    `lora.trainable`, hold the frozen matmul weights in `compute_dtype`, and keep the frozen tensors out of the
    state dict. Call it on the fp32 model after the rope patch and the packed forward, before gradient
    checkpointing, compile and the optimizer. Raises ValueError if the model already has adapters or a target
    name matches nothing."""
    if any(isinstance(m, LoraLayer) for m in model.modules()):
        raise ValueError("this model already has LoRA adapters.")
    targets = target_modules(model, lora_cfg)
    trained = trained_modules(model, lora_cfg.trainable)
    peft.inject_adapter_in_model(peft_config(lora_cfg, targets), model, adapter_name=ADAPTER)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            # x reaches the adapter in the dtype autocast multiplies in anyway: peft's cast of x to the adapter's fp32
            # would only add two copies of x per layer, the products unchanged
            module.cast_input_dtype_enabled = False
    for name, param in model.named_parameters():  # what trains is set here, whatever peft's defaults
        param.requires_grad_("lora_" in name)
    for name in trained:
        model.get_submodule(name).requires_grad_(True)
    frozen_cast = cast_frozen_weights(model, compute_dtype)
    model.get_input_embeddings().register_forward_hook(_output_requires_grad)
    model.register_state_dict_post_hook(_drop_frozen)
    model.register_load_state_dict_post_hook(_frozen_not_missing)
    adapter_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    trained_params = sum(p.numel() for name in trained for p in model.get_submodule(name).parameters())
    report = LoraReport(tuple(targets), tuple(trained), adapter_params, trained_params, frozen_cast)
    log.info("%s", report)
    return report


def cast_frozen_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Hold every frozen matmul weight (`cast_param_ids`) and an untied frozen lm_head in `dtype`; the count cast.

    A frozen tensor has no gradient and needs no master: autocast would round it to these same values at every use
    (the fused loss casts the lm_head itself). The input embeddings, norms and gates stay fp32."""
    if dtype == torch.float32:
        return 0
    cast = cast_param_ids(model)
    lm_head = model.lm_head.weight
    if lm_head is not model.get_input_embeddings().weight:
        cast.add(id(lm_head))
    count = 0
    with torch.no_grad():
        for param in model.parameters():
            if id(param) in cast and not param.requires_grad and param.dtype != dtype:
                param.data = param.data.to(dtype)
                count += 1
    return count


def _output_requires_grad(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    """Forward hook on the input embeddings: their output takes a gradient, so every pack's first decoder layer runs
    its backward. With frozen embeddings that layer's input would need a gradient only in a pack with images (from a
    trained merger or ViT): under FSDP2, whose units reduce their gradients as autograd reaches their inputs, a rank
    with a text-only pack would reduce the first layer's at the end of backward instead, out of order with a rank
    that has images, and both would wait forever. The cost is the first layer's input gradients (transformers'
    `enable_input_require_grads` does the same for frozen embeddings)."""
    if torch.is_grad_enabled():
        output.requires_grad_(True)


def _drop_frozen(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook: remove the frozen parameters (unless `full_state_dict` is on)."""
    if getattr(module, _KEEP_FROZEN, False):
        return
    for name, param in module.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            state_dict.pop(prefix + name, None)


def _frozen_not_missing(module: nn.Module, incompatible_keys) -> None:
    """Load-state-dict post-hook: a frozen parameter absent from the loaded state is not missing (it comes from the
    base model's source). Keys carry the prefixes of the modules around this one (TrainModule, DDP)."""
    frozen = {name for name, param in module.named_parameters(remove_duplicate=False) if not param.requires_grad}
    missing = incompatible_keys.missing_keys
    missing[:] = [key for key in missing if not _ends_with_one_of(key, frozen)]


def _ends_with_one_of(key: str, names: set[str]) -> bool:
    pieces = key.split(".")
    return any(".".join(pieces[i:]) in names for i in range(len(pieces)))


@contextlib.contextmanager
def full_state_dict(model: nn.Module) -> Iterator[None]:
    """Within: `model`'s state dict holds its frozen tensors too (the export's merge needs the base)."""
    setattr(model, _KEEP_FROZEN, True)
    try:
        yield
    finally:
        setattr(model, _KEEP_FROZEN, False)


def lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    """{module path: peft LoRA layer} of `model`."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def _adapter_key(name: str, kind: str) -> str:
    return f"{name}.{kind}.{ADAPTER}.weight"


def merged_state(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """`state` (the full state dict of `model`, HF paths) with every adapter folded into its base layer and the
    LoRA structure gone: `<layer>.weight` = W + scaling · B A (in fp32, returned in W's dtype), `<layer>.bias` =
    the base bias; the keys of the model without adapters. The other tensors are passed through as they are."""
    merged = dict(state)
    for name, layer in lora_layers(model).items():
        base = merged.pop(f"{name}.base_layer.weight")
        down, up = merged.pop(_adapter_key(name, "lora_A")), merged.pop(_adapter_key(name, "lora_B"))
        delta = (up.float() @ down.float()) * layer.scaling[ADAPTER]
        merged[f"{name}.weight"] = (base.float() + delta).to(base.dtype)
        if f"{name}.base_layer.bias" in merged:
            merged[f"{name}.bias"] = merged.pop(f"{name}.base_layer.bias")
    leftover = [key for key in merged if ".lora_" in key or ".base_layer." in key]
    if leftover:
        raise ValueError(f"adapter tensors that merged_state cannot fold in: {leftover[:5]}")
    return merged


def adapter_state(state: dict[str, torch.Tensor], model: nn.Module, trained: tuple[str, ...]) -> dict:
    """The adapter as PeftModel.save_pretrained writes it: `base_model.model.<layer>.lora_A.weight` / `lora_B`, and
    each fully trained module's tensors under `base_model.model.<module>.` (peft's modules_to_save)."""
    out = {}
    for name in lora_layers(model):
        for kind in ("lora_A", "lora_B"):
            out[f"{PEFT_PREFIX}{name}.{kind}.weight"] = state[_adapter_key(name, kind)]
    for module in trained:
        for key, value in state.items():
            if key.startswith(module + "."):
                out[PEFT_PREFIX + key] = value
    return out


def export_adapter(
    directory: Path,
    state: dict[str, torch.Tensor],
    model: nn.Module,
    lora_cfg: LoraConfig,
    base_model: str | None,
    dtype: torch.dtype,
) -> Path:
    """Write the adapter of `model` (its full `state`, HF paths) into `directory` in peft's format, tensors in
    `dtype`: adapter_config.json and adapter_model.safetensors, for `peft.PeftModel.from_pretrained(base, directory)`
    with `base` the model `base_model` names (or the run's random init)."""
    trained = tuple(trained_modules(model, lora_cfg.trainable))
    config = peft_config(lora_cfg, sorted(lora_layers(model)), base_model)
    config.modules_to_save = list(trained) or None
    config.save_pretrained(str(directory))
    # copies: safetensors refuses tensors that share memory (an lm_head trained with the embeddings it is tied to)
    weights = {
        key: value.to("cpu", dtype if value.is_floating_point() else value.dtype, copy=True).contiguous()
        for key, value in adapter_state(state, model, trained).items()
    }
    save_file(weights, str(directory / "adapter_model.safetensors"))
    log.info("adapter written to %s (%d tensors)", directory, len(weights))
    return directory
