"""Put the fused rotary kernels into transformers' Qwen-VL models, exactly and reversibly.

transformers computes rotary embeddings in two steps: a rotary module builds (cos, sin) tables once per forward,
every attention layer unpacks `cos, sin = position_embeddings` and calls the module-global `apply_rotary_pos_emb`
(text) or `apply_rotary_pos_emb_vision` (vision). The patch keeps that call structure and changes what flows
through it:

- each rotary module instance gets a `forward` that returns `(positions, args)` instead of `(cos, sin)`: the
  integer positions and a small record with what the kernel needs: for text inv_freq, mrope sections, layout and
  attention_scaling (nothing materialized); for vision the (T, D) fp32 cos/sin table of `ops.vision_rope_table`,
  built once per tower forward and read by every block, forward and backward. The record carries the config, so
  two differently-configured models of one family can be patched at once.
- the family's module-global apply functions are replaced by dispatchers that call `apply_mrope` /
  `apply_vision_rope_table` when handed such a record, and the original function otherwise (an unpatched model of the
  same family keeps working). The originals come back when the last patched model of the family is unpatched.
- Qwen2.5-VL's vision tower reorders the rotary tables into window order with `permute_input_for_window_attn`;
  its instance gets a version that reorders the positions and the record's table rows alike.

The patch refuses (PatchError) anything it cannot reproduce exactly, validates everything before changing
anything, and records what it replaced on the model so `unpatch_model` restores the original objects.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import logging
import types
import weakref
from typing import Literal

import torch
import transformers

from core.families import FAMILIES, Family
from mrope_kernels import ops

logger = logging.getLogger(__name__)

# transformers versions whose six Qwen-VL modeling files the patch is written and tested against.
TESTED_TRANSFORMERS_VERSIONS = ("5.17.0", "5.23.0")

TEXT_APPLY = "apply_rotary_pos_emb"
VISION_APPLY = "apply_rotary_pos_emb_vision"
WINDOW_PERMUTE = "permute_input_for_window_attn"
_STATE_ATTR = "_fused_rope_patch"


class PatchError(ValueError):
    """The model cannot be patched (or unpatched) exactly; the message says why and what to do."""


class MRopeArgs:
    """What text attention needs to rotate q/k with `apply_mrope`; travels in the `sin` slot of HF's
    `position_embeddings`, next to the integer positions (3, B, S) in the `cos` slot.

    inv_freq: fp32 (R/2,) on the activations' device; mrope_section: three ints summing to R/2.
    A plain class on purpose, not a dataclass or tuple: mixed-precision wrappers cast the floating-point forward
    inputs of each wrapped block, recursing into tuples and dataclasses (FSDP2 does), which would round inv_freq.
    """

    __slots__ = ("attention_scaling", "interleaved", "inv_freq", "mrope_section")

    def __init__(
        self, inv_freq: torch.Tensor, mrope_section: tuple[int, int, int], interleaved: bool, attention_scaling: float
    ):
        self.inv_freq = inv_freq
        self.mrope_section = mrope_section
        self.interleaved = interleaved
        self.attention_scaling = attention_scaling


class VisionRopeArgs:
    """What vision attention needs for `apply_vision_rope_table`; travels in the `sin` slot next to the integer
    [row, col] positions (N, 2). table: fp32 (N, head_dim), `ops.vision_rope_table` of those positions. A plain
    class for the reason MRopeArgs is (a cast would round the table)."""

    __slots__ = ("table",)

    def __init__(self, table: torch.Tensor):
        self.table = table


@dataclasses.dataclass(frozen=True)
class ReplacedModule:
    """One module instance whose method the patch overrides. path: name in `model.named_modules()`."""

    path: str
    cls: str
    method: str
    flavour: str  # e.g. "text mRoPE interleaved [24, 20, 20], R=128 of D=128" or "vision 2-D rope, D=80"


@dataclasses.dataclass(frozen=True)
class PatchReport:
    """What `patch_model` replaced: module instances, module-global functions, and the attention classes that
    now reach the kernels through those functions."""

    family: str
    transformers_version: str
    modules: tuple[ReplacedModule, ...]
    functions: tuple[str, ...]
    attention_classes: tuple[str, ...]

    def __str__(self) -> str:
        lines = [f"fused rope patch: {self.family} (transformers {self.transformers_version})"]
        lines += [f"  {m.path or '<root>'} ({m.cls}.{m.method}): {m.flavour}" for m in self.modules]
        lines += [f"  function {name}" for name in self.functions]
        lines.append(f"  attention classes: {', '.join(self.attention_classes)}")
        return "\n".join(lines)


@dataclasses.dataclass
class _PatchState:
    """Kept on the patched model (attribute `_fused_rope_patch`) so unpatching needs nothing else.

    `release` gives the model's hold on its family's module-global functions back exactly once: when
    `unpatch_model` calls it, or when the model is garbage-collected without being unpatched, so a dropped
    patched model never leaves transformers' functions replaced."""

    report: PatchReport
    overrides: list[tuple[torch.nn.Module, str]]
    release: weakref.finalize

    def __deepcopy__(self, memo: dict) -> _PatchState:
        """A deep copy of a patched model is patched too (its modules carry the copied overrides): it takes its
        own hold on the family's functions, so they stay replaced until both are unpatched or collected."""
        modeling_name = FAMILIES[self.report.family].modeling_module
        _GLOBAL_PATCHES[modeling_name].patched_models += 1
        model_copy = memo[id(self.release.peek()[0])]  # deepcopy memoizes the new model before copying its state
        return _PatchState(self.report, copy.deepcopy(self.overrides, memo), _hold(model_copy, modeling_name))


def _hold(model: torch.nn.Module, modeling_name: str) -> weakref.finalize:
    release = weakref.finalize(model, _release_globals, modeling_name)
    release.atexit = False  # nothing to restore in a process that is exiting
    return release


@dataclasses.dataclass
class _GlobalPatch:
    originals: dict[str, object]
    patched_models: int


# modeling module name -> originals of its apply functions, while at least one model of the family is patched.
_GLOBAL_PATCHES: dict[str, _GlobalPatch] = {}


def patch_model(model: torch.nn.Module) -> PatchReport:
    """Route every rotary embedding of a transformers Qwen-VL model through the fused kernels.

    model: a ForConditionalGeneration, Model (VL) or text-only model (TextModel, ForCausalLM) of qwen2_vl,
    qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5 or qwen3_5_moe, any dtype and device. Raises PatchError (and
    changes nothing) when the model is not one of these, is already patched, or uses a rotary config the kernels
    do not reproduce exactly (rope_type other than default/axial, attention_scaling != 1, an untested
    transformers version). Returns what was replaced.
    """
    if transformers.__version__ not in TESTED_TRANSFORMERS_VERSIONS:
        raise PatchError(
            f"transformers {transformers.__version__} is untested with the fused rope patch (tested: "
            f"{', '.join(TESTED_TRANSFORMERS_VERSIONS)}); pin one of those or use the unfused rope."
        )
    if _STATE_ATTR in model.__dict__:
        raise PatchError(f"{type(model).__name__} is already patched; call unpatch_model first.")

    family, rotaries = _find_rotary_modules(model)
    modeling = importlib.import_module(family.modeling_module)
    overrides, replaced, function_names = _plan_overrides(model, family, rotaries)
    attention_classes = _attention_classes_calling(model, family, function_names)

    for module, attr, method in overrides:
        setattr(module, attr, method)
    _acquire_globals(modeling, function_names)
    report = PatchReport(
        family=family.model_type,
        transformers_version=transformers.__version__,
        modules=tuple(replaced),
        functions=tuple(f"{family.modeling_module}.{name}" for name in function_names),
        attention_classes=attention_classes,
    )
    model.__dict__[_STATE_ATTR] = _PatchState(
        report, [(module, attr) for module, attr, _ in overrides], _hold(model, family.modeling_module)
    )
    return report


def unpatch_model(model: torch.nn.Module) -> None:
    """Undo `patch_model(model)`: the original methods and module-global functions are back, so outputs are
    bit-identical to a never-patched model. Raises PatchError if `model` itself was not patched."""
    state = model.__dict__.get(_STATE_ATTR)
    if state is None:
        patched_inside = [name for name, m in model.named_modules() if _STATE_ATTR in m.__dict__]
        where = f"; its submodule {patched_inside[0]!r} is: unpatch that" if patched_inside else ""
        raise PatchError(f"{type(model).__name__} is not patched{where}.")
    for module, attr in state.overrides:
        del module.__dict__[attr]
    state.release()
    del model.__dict__[_STATE_ATTR]


def apply_rope_choice(model: torch.nn.Module, choice: Literal["fused", "unfused", "auto"]) -> PatchReport | None:
    """The `kernels.rope` recipe choice: "fused" patches or raises PatchError; "unfused" leaves transformers'
    rotary in place; "auto" patches when possible and otherwise logs a warning with the reason. Returns the
    report, or None when the model runs transformers' own rotary."""
    if choice == "unfused":
        return None
    if choice == "fused":
        return patch_model(model)
    if choice == "auto":
        try:
            return patch_model(model)
        except PatchError as err:
            logger.warning("fused rope unavailable, using transformers' rotary instead: %s", err)
            return None
    raise ValueError(f"rope choice must be 'fused', 'unfused' or 'auto', got {choice!r}.")


def _plan_overrides(
    model: torch.nn.Module, family: Family, rotaries: list[tuple[str, torch.nn.Module]]
) -> tuple[list[tuple[torch.nn.Module, str, types.MethodType]], list[ReplacedModule], list[str]]:
    """Validate every rotary module and build (without applying) the instance overrides, their report entries and
    the module-global functions they need; PatchError on the first thing that cannot be reproduced exactly."""
    overrides, replaced, function_names = [], [], set()
    for path, module in rotaries:
        if "forward" in module.__dict__:
            raise PatchError(
                f"{path} ({type(module).__name__}) already has an instance-level forward (patched, or wrapped by "
                "a hook); patch the model before adding hooks, or unpatch it first."
            )
        if type(module).__name__ == family.text_rotary:
            forward, flavour = _text_rotary_forward(path, module, family)
            function_names.add(TEXT_APPLY)
        else:
            forward, flavour = _vision_rotary_forward(path, module)
            function_names.add(VISION_APPLY)
        overrides.append((module, "forward", forward))
        replaced.append(ReplacedModule(path, type(module).__name__, "forward", flavour))
    for path, module in model.named_modules():
        if type(module).__name__ != family.window_vision_model:
            continue
        if not callable(getattr(module, WINDOW_PERMUTE, None)) or WINDOW_PERMUTE in module.__dict__:
            raise PatchError(f"{path} ({type(module).__name__}) has no class method {WINDOW_PERMUTE} to extend.")
        overrides.append((module, WINDOW_PERMUTE, types.MethodType(_permute_passing_rope_args, module)))
        replaced.append(ReplacedModule(path, type(module).__name__, WINDOW_PERMUTE, "window reorder of positions"))
    return overrides, replaced, sorted(function_names)


def _find_rotary_modules(model: torch.nn.Module) -> tuple[Family, list[tuple[str, torch.nn.Module]]]:
    """The model's family and its text/vision rotary module instances; PatchError if none or several families."""
    by_class = {}
    for family in FAMILIES.values():
        by_class[(family.modeling_module, family.text_rotary)] = family
        by_class[(family.modeling_module, family.vision_rotary)] = family
    found: dict[str, list[tuple[str, torch.nn.Module]]] = {}
    for path, module in model.named_modules():
        cls = type(module)
        family = by_class.get((cls.__module__, cls.__name__))
        if family is not None:
            found.setdefault(family.model_type, []).append((path, module))
        elif cls.__name__.endswith("RotaryEmbedding") and cls.__module__ in {
            f.modeling_module for f in FAMILIES.values()
        }:
            raise PatchError(f"{path} is a {cls.__qualname__}, a rotary class the fused rope patch does not know.")
    if not found:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise PatchError(
            f"{type(model).__name__} (model_type {model_type!r}) has no rotary module the fused rope patch knows; "
            f"supported families: {', '.join(FAMILIES)}."
        )
    if len(found) > 1:
        raise PatchError(f"{type(model).__name__} mixes rotary modules of several families: {sorted(found)}.")
    name, rotaries = next(iter(found.items()))
    return FAMILIES[name], rotaries


def _scaling_of(path: str, module: torch.nn.Module) -> float:
    scaling = module.attention_scaling
    if not isinstance(scaling, (int, float)) or scaling != 1.0:
        raise PatchError(
            f"{path} has attention_scaling {scaling!r}; the fused rope patch reproduces only 1.0 (the default and "
            "axial rope types). Use the unfused rope for this model."
        )
    return float(scaling)


def _text_rotary_forward(path: str, module: torch.nn.Module, family: Family) -> tuple[types.MethodType, str]:
    """Validated replacement forward for a text rotary module, and its flavour for the report."""
    if module.rope_type != "default":
        raise PatchError(
            f"{path} uses rope_type {module.rope_type!r}; the fused rope patch reproduces only 'default' exactly "
            "(scaled variants change inv_freq per call or rescale cos/sin). Use the unfused rope for this model."
        )
    scaling = _scaling_of(path, module)
    section = tuple(int(s) for s in module.mrope_section)
    half = module.inv_freq.shape[-1]
    if len(section) != 3 or sum(section) != half:
        raise PatchError(
            f"{path} has mrope_section {list(section)} for {half} frequencies; it needs three ints summing to {half}."
        )
    config = module.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layout = "interleaved" if family.interleaved else "chunked"
    flavour = f"text mRoPE {layout} {list(section)}, R={2 * half} of D={head_dim}"
    args = dict(mrope_section=section, interleaved=family.interleaved, attention_scaling=scaling)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, MRopeArgs]:
        """x: the hidden states (device only); position_ids: int (3, B, S) or (B, S). Returns the positions
        as (3, B, S) and the kernel arguments, in place of (cos, sin). The default rope type has nothing for
        `dynamic_rope_update` to do, so inv_freq is read as is."""
        inv_freq = self.inv_freq.to(device=x.device, dtype=torch.float32)
        return position_ids.expand(3, -1, -1), MRopeArgs(inv_freq=inv_freq, **args)

    return types.MethodType(forward, module), flavour


def _vision_rotary_forward(path: str, module: torch.nn.Module) -> tuple[types.MethodType, str]:
    """Validated replacement forward for a vision rotary module, and its flavour for the report."""
    if module.rope_type != "axial":
        raise PatchError(f"{path} uses vision rope_type {module.rope_type!r}; the fused rope patch reproduces 'axial'.")
    _scaling_of(path, module)
    head_dim = 4 * module.inv_freq.shape[-1]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, VisionRopeArgs]:
        """x: the patch embeddings (device only); position_ids: int (N, 2) [row, col]. Returns the positions
        and their cos/sin table in place of (cos, sin): one table per tower forward, for every block."""
        inv_freq = self.inv_freq.to(device=x.device, dtype=torch.float32)
        return position_ids, VisionRopeArgs(ops.vision_rope_table(position_ids, inv_freq))

    return types.MethodType(forward, module), f"vision 2-D rope, D={head_dim}"


def _permute_passing_rope_args(self, input_tensor, window_index: torch.Tensor, seq_len: int):
    """Qwen2.5-VL's window reorder for the patched tower: positions (N, 2) and the record's table (N, D) reorder
    like any per-patch tensor (exactly as the cos/sin tables did)."""
    permute = type(self).permute_input_for_window_attn
    if isinstance(input_tensor, VisionRopeArgs):
        return VisionRopeArgs(permute(self, input_tensor.table, window_index, seq_len))
    return permute(self, input_tensor, window_index, seq_len)


def _attention_classes_calling(model: torch.nn.Module, family: Family, function_names: list[str]) -> tuple[str, ...]:
    """Classes in the model whose forward calls one of the apply functions by its module-global name; PatchError
    if a patched function has no caller (transformers changed how attention applies rotary)."""
    callers: dict[str, set[str]] = {name: set() for name in function_names}
    for module in model.modules():
        cls = type(module)
        if cls.__module__ != family.modeling_module:
            continue
        code_names = inspect.unwrap(cls.forward).__code__.co_names
        for name in function_names:
            if name in code_names:
                callers[name].add(cls.__name__)
    for name, classes in callers.items():
        if not classes:
            raise PatchError(
                f"no module of {type(model).__name__} calls {family.modeling_module}.{name}; this transformers "
                "version applies rotary differently and the patch would do nothing."
            )
    return tuple(sorted(set().union(*callers.values())))


def _acquire_globals(modeling: types.ModuleType, function_names: list[str]) -> None:
    """Install the dispatchers in the family's modeling module (first patched model of the family only)."""
    patch = _GLOBAL_PATCHES.get(modeling.__name__)
    if patch is None:
        patch = _GlobalPatch(originals={}, patched_models=0)
        _GLOBAL_PATCHES[modeling.__name__] = patch
    for name in function_names:
        if name not in patch.originals:
            original = getattr(modeling, name)
            patch.originals[name] = original
            make = _make_text_apply if name == TEXT_APPLY else _make_vision_apply
            setattr(modeling, name, make(original))
    patch.patched_models += 1


def _release_globals(modeling_name: str) -> None:
    """Restore the family's original apply functions once no patched model of the family is left."""
    patch = _GLOBAL_PATCHES[modeling_name]
    patch.patched_models -= 1
    if patch.patched_models == 0:
        modeling = importlib.import_module(modeling_name)
        for name, original in patch.originals.items():
            setattr(modeling, name, original)
        del _GLOBAL_PATCHES[modeling_name]


def _make_text_apply(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        """Fused stand-in for transformers' text apply. q (B, Hq, S, D), k (B, Hk, S, D) views (unsqueeze_dim 1,
        HF's layout) or (B, S, H, D) (unsqueeze_dim 2); cos: int positions (3, B, S); sin: MRopeArgs. Returns
        (q, k) rotated, in the input layout and dtype. Plain cos/sin tables go to the original function."""
        if not isinstance(sin, MRopeArgs):
            return original(q, k, cos, sin, unsqueeze_dim)
        if unsqueeze_dim not in (1, 2):
            raise ValueError(f"unsqueeze_dim must be 1 (B, H, S, D) or 2 (B, S, H, D), got {unsqueeze_dim}.")
        heads_first = unsqueeze_dim == 1
        rope_args = (cos, sin.inv_freq, sin.mrope_section, sin.interleaved, sin.attention_scaling)
        if 2 * sin.inv_freq.shape[0] < q.shape[-1]:
            targets = _in_place_targets(q, k, heads_first)
            if targets is not None:
                (q_dst, k_dst), dst_heads_first = targets
                q_dst, k_dst = ops.apply_mrope(q_dst, k_dst, *rope_args, heads_first=dst_heads_first, inplace=True)
                return (
                    (q_dst.transpose(1, 2), k_dst.transpose(1, 2)) if dst_heads_first != heads_first else (q_dst, k_dst)
                )
        # (B, H, S, D) rotates as it is: transposed views would add host time, forward and as backward nodes.
        return ops.apply_mrope(q, k, *rope_args, heads_first=heads_first)

    apply_rotary_pos_emb.original = original
    return apply_rotary_pos_emb


def _in_place_targets(q, k, heads_first: bool):
    """Partial rotary (Qwen3.5: 64 of 256 lanes) in place where that is exact and cheaper: ((q', k'), heads_first')
    to rotate in place, or None for the out-of-place call. Eager autograd only (a traced graph keeps the out-of-place
    op; without grad mode the caller's tensors are left as they are). Each of q, k must be the output of an
    autograd-tracked op, or transformers' (B, H, S, D) transpose of one, whose (B, S, H, D) base is then rotated:
    autograd rebases an in-place write to a view by copying the whole gradient in backward, which would cost more
    than the lanes saved. transformers' attention rebinds q and k to the rope's results, and an op that saved the
    tensor for its backward makes autograd raise at the write (mark_dirty), so no gradient is silently wrong."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return None
    tracked = [_tracked_target(x, heads_first) for x in (q, k)]
    if None in tracked or tracked[0][1] != tracked[1][1]:
        return None
    return (tracked[0][0], tracked[1][0]), tracked[0][1]


def _tracked_target(x: torch.Tensor, heads_first: bool):
    """(tensor, heads_first) to rotate in place for `x`, or None (see `_in_place_targets`)."""
    base = x._base
    if base is None:
        return (x, heads_first) if x.grad_fn is not None else None
    if not heads_first or base.grad_fn is None or base.dim() != 4:
        return None
    as_base = base.transpose(1, 2)
    same_view = as_base.shape == x.shape and as_base.stride() == x.stride()
    return (base, False) if same_view and as_base.storage_offset() == x.storage_offset() else None


def _make_vision_apply(original):
    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        """Fused stand-in for transformers' vision apply. q, k (N, H, D); cos: int positions (N, 2) [row, col];
        sin: VisionRopeArgs, their table. Returns (q, k) rotated, dtype of the inputs (fp32 math, as transformers)."""
        if not isinstance(sin, VisionRopeArgs):
            return original(q, k, cos, sin)
        return ops.apply_vision_rope_table(q, k, sin.table)

    apply_rotary_pos_emb_vision.original = original
    return apply_rotary_pos_emb_vision
