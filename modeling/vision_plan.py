"""The vision tower's grid metadata, computed on the host before the forward instead of from the device grid.

transformers' vision towers derive their per-call metadata (rotary position ids, per-frame `cu_seqlens` and
`max_seqlen`, Qwen2.5-VL's window order and window boundaries, Qwen3-VL/3.5's position-embedding interpolation
taps) from `grid_thw` on the device: `.tolist()`, `.item()` and dozens of tiny launches per call, each sync
draining the GPU queue. In transformers >= 5.23 every one of those helpers (transformers/vision_utils.py) first
pops a precomputed value from the tower's kwargs. This module

- computes those values on the host (`plan_kwargs`) by calling the same helpers with the tower's own settings, on
  a CPU grid, so they are identical by construction; tensors go to the device from pinned memory without blocking,
  the max seqlens stay Python ints;
- hands them to the tower (`VisionPlans`) through a forward pre-hook on `model.model.visual`, matched to the call
  by the identity of its `grid_thw` tensor. They cannot be top-level model kwargs: the model forwards the same
  kwargs to the image call, the video call and the text model (`position_ids`, `cu_seqlens` would collide).

train.py's loaders plan each batch's grids in their DataLoader workers, while they collate (`VisionPlanner`, a
picklable copy of what planning reads of the tower; `HOST_PLANS` in the batch), so the GPU does not sit idle
while the step's host plans (docs/performance.md). The step then only copies the plans to the device, and plans a
grid itself only when the batch has no plan of it, or one made for another attention implementation. The batch's
plans go to the device with its other tensors (`to_device`).

A call whose grid has no plan is left untouched (transformers derives everything itself): per-sample references,
verification/packing_check.py and any model call outside `TrainModule.forward`.

The host grids travel in the batch as tuples of ints under `HOST_GRIDS` (set by trainer/step.py `to_device`),
not as tensors: DDP and FSDP2 move every tensor of a root module's inputs to the device.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import vision_utils
from transformers.utils.generic import get_max_seqlen

log = logging.getLogger(__name__)

HOST_GRIDS = "host_grids"
"""Batch key: {"image_grid_thw": ((t, h, w), ...), "video_grid_thw": ...}, the grids as host tuples of ints."""
HOST_PLANS = "vision_host_plans"
"""Batch key: the grids' plans made by the loader workers (`VisionPlanner.add_host_plans`)."""
GRID_KEYS = ("image_grid_thw", "video_grid_thw")

# Which helpers each family's visual forward calls (transformers 5.23 vision `forward`s):
# "rope": get_vision_position_ids + get_vision_attention_seqlens (position_ids, cu_seqlens, max_seqlen);
# "window": get_vision_window_index + get_max_seqlen(kwarg_name="max_window_seqlen") (Qwen2.5-VL);
# "interp": get_vision_interpolation_indices_and_weights (Qwen3-VL / Qwen3.5 learned position-embedding resampling).
_FAMILY_PARTS = {
    "Qwen2VisionTransformerPretrainedModel": ("rope",),
    "Qwen2_5_VisionTransformerPretrainedModel": ("rope", "window"),
    "Qwen3VLVisionModel": ("interp", "rope"),
    "Qwen3VLMoeVisionModel": ("interp", "rope"),
    "Qwen3_5VisionModel": ("interp", "rope"),
    "Qwen3_5MoeVisionModel": ("interp", "rope"),
}
_PART_HELPERS = {
    "rope": ("get_vision_position_ids", "get_vision_attention_seqlens"),
    "window": ("get_vision_window_index", "max_window_seqlen"),
    "interp": ("get_vision_interpolation_indices_and_weights",),
}


def vision_parts(visual: nn.Module) -> tuple[str, ...]:
    """The precomputable parts of `visual`'s forward (see `_FAMILY_PARTS`).

    Raises ValueError for a tower class this module does not know, or whose forward no longer calls the helpers
    the table says it does (another transformers version): a plan must be exactly what the tower would derive."""
    return _class_parts(type(visual))


@functools.cache
def _class_parts(visual_cls: type) -> tuple[str, ...]:
    cls = next((c for c in visual_cls.__mro__ if c.__name__ in _FAMILY_PARTS), None)  # FSDP2 subclasses it
    if cls is None:
        raise ValueError(f"no vision plan for {visual_cls.__name__}; known: {', '.join(_FAMILY_PARTS)}.")
    parts = _FAMILY_PARTS[cls.__name__]
    source = inspect.getsource(cls.forward)
    missing = [name for part in parts for name in _PART_HELPERS[part] if name not in source]
    if missing:
        raise ValueError(f"{cls.__name__}.forward no longer calls {missing}: its vision plan would be wrong.")
    return parts


class VisionPlanner:
    """What `plan_kwargs` reads of a tower (its family's parts, its config and settings), without the tower: a
    small picklable object, so DataLoader workers can plan each batch's grids while they collate it
    (`add_host_plans`) and the training step only copies the plans to the device."""

    def __init__(self, visual: nn.Module):
        self.parts = vision_parts(visual)
        self.config = visual.config  # its attention implementation decides whether there are max seqlens
        self.merge = visual.spatial_merge_size
        if "window" in self.parts:
            self.window_size, self.patch_size = visual.window_size, visual.patch_size
        if "interp" in self.parts:
            self.num_grid_per_side = visual.num_grid_per_side
            self.interpolation = (visual.interpolation_mode, visual.interpolation_align_corners)

    @property
    def attn(self) -> str | None:
        return self.config._attn_implementation

    def host_kwargs(self, grid_thw: torch.Tensor) -> dict:
        """`plan_kwargs` on the host: its tensors on the CPU (not pinned), the max seqlens Python ints, and no key
        for a value transformers leaves None (no flash attention: no max seqlens)."""
        if grid_thw.device.type != "cpu":
            raise ValueError("a vision plan takes the host grid (a device grid would sync to be read).")
        out: dict = {}
        if "interp" in self.parts:
            mode, align_corners = self.interpolation
            out["interp_indices"], out["interp_weights"] = vision_utils.get_vision_interpolation_indices_and_weights(
                grid_thw,
                num_grid_per_side=self.num_grid_per_side,
                mode=mode,
                align_corners=align_corners,
                spatial_merge_size=self.config.spatial_merge_size,
            )
        out["position_ids"] = vision_utils.get_vision_position_ids(grid_thw, self.merge)
        out["cu_seqlens"], out["max_seqlen"] = vision_utils.get_vision_attention_seqlens(grid_thw, self.config)
        if "window" in self.parts:
            out["window_index"], out["cu_window_seqlens"] = vision_utils.get_vision_window_index(
                grid_thw, spatial_merge_size=self.merge, window_size=self.window_size, patch_size=self.patch_size
            )
            out["max_window_seqlen"] = get_max_seqlen(out["cu_window_seqlens"], self.config)
        return {
            key: value if isinstance(value, torch.Tensor) else int(value)
            for key, value in out.items()
            if value is not None
        }

    def add_host_plans(self, batch: dict) -> dict:
        """`batch` with its grids' host plans under `HOST_PLANS` (in the loader workers, after collation):
        {grid key: {"rows": ((t, h, w), ...), "attn": the attention implementation planned for, "kwargs":
        host_kwargs(grid)}} for every host grid tensor it has."""
        plans = {
            key: {"rows": _rows(grid), "attn": self.attn, "kwargs": self.host_kwargs(grid)}
            for key in GRID_KEYS
            if isinstance(grid := batch.get(key), torch.Tensor) and grid.device.type == "cpu"
        }
        return {**batch, HOST_PLANS: plans} if plans else batch


def plan_kwargs(visual: nn.Module, grid_thw: torch.Tensor, device: torch.device | str) -> dict:
    """The kwargs `visual(pixels, grid_thw=...)` pops from its call, computed from a host grid.

    grid_thw: long (n, 3) on the CPU, the call's (t, h, w) per image or video; device: where the tower runs.
    Returns {"position_ids": long (P, 2), "cu_seqlens": int32 (frames+1,), "max_seqlen": int}, plus for Qwen2.5-VL
    "window_index" long (P/merge²,), "cu_window_seqlens" int32, "max_window_seqlen" int, and for Qwen3-VL/3.5
    "interp_indices" long (P, 4), "interp_weights" fp32 (P, 4); tensors on `device` (copied from pinned memory
    without blocking on CUDA). The max seqlens are left out when the tower's attention is not a flash one
    (transformers then passes None, and so does the plan).
    """
    return _on_device(VisionPlanner(visual).host_kwargs(grid_thw), device)


def host_plans_to(plans: dict, device: torch.device | str) -> dict:
    """A batch's `HOST_PLANS` with their tensors on `device`, copied without blocking (trainer/step.py
    `to_device`, with the batch's other tensors: under DDP or FSDP2, which move every tensor of a root module's
    inputs, nothing is left for them to copy)."""
    return {key: {**plan, "kwargs": _on_device(plan["kwargs"], device)} for key, plan in plans.items()}


def _on_device(kwargs: dict, device: torch.device | str) -> dict:
    """A plan's tensors on `device`, copied without blocking (from pinned memory on CUDA: pinned here unless the
    batch prefetcher already pinned them)."""
    pin = torch.device(device).type == "cuda"
    return {
        key: (value.pin_memory() if pin and value.device.type == "cpu" else value).to(device, non_blocking=True)
        if isinstance(value, torch.Tensor)
        else value
        for key, value in kwargs.items()
    }


def _rows(grid: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    return _as_rows(grid.tolist())


def _as_rows(rows) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(value) for value in row) for row in rows)


@dataclass
class _Plan:
    grid: torch.Tensor  # the exact tensor object the tower will be called with
    kwargs: dict
    attn: str | None = None  # the tower's attention implementation when planned


def host_grids(batch: dict) -> dict:
    """{grid key: ((t, h, w), ...)} for the batch's host grid tensors (free to read: they are on the CPU)."""
    return {
        key: _rows(grid)
        for key in GRID_KEYS
        if isinstance(grid := batch.get(key), torch.Tensor) and grid.device.type == "cpu"
    }


class VisionPlans:
    """Precomputed vision kwargs for the current forward, injected into the tower's calls by a pre-hook.

    `prepare_batch(inputs, host_grids)` (or `prepare(grid, host_rows)` for one call) plans a forward's calls,
    `clear()` drops them; a call whose `grid_thw` is not (by identity) a planned grid is left untouched.
    `constant(grid, host_rows)` plans a grid that never changes (the dummy image) once, across forwards.
    Gradient checkpointing recomputes vision blocks with the arguments they were first called with, never the
    tower's forward, so the hook runs once per call. `remove()` undoes it.
    """

    def __init__(self, visual: nn.Module):
        vision_parts(visual)  # refuse an unknown tower now, not at the first step
        self.visual = visual
        self._plans: dict[int, _Plan] = {}
        self._constants: dict[int, _Plan] = {}
        self._warned_stale = False
        self._hook = visual.register_forward_pre_hook(self._inject, with_kwargs=True)

    def prepare(self, grid: torch.Tensor, host_rows, host_plan: dict | None = None) -> None:
        """Plan the call with `grid` (the tensor the tower will receive, on any device) from `host_rows`, the same
        grid as host ints ((t, h, w), ...); the plan's tensors go to the tower's device. `host_plan`: the loader
        workers' plan of this grid (`VisionPlanner.add_host_plans`), used when it is of these rows and of the
        tower's current attention implementation, else planned here."""
        device = _tower_device(self.visual, grid)
        rows = _as_rows(host_rows)
        attn = self.visual.config._attn_implementation
        # the loader hands tuples over as lists
        fresh = host_plan is not None and _as_rows(host_plan["rows"]) == rows and host_plan["attn"] == attn
        if fresh:
            kwargs = _on_device(host_plan["kwargs"], device)
        else:
            if host_plan is not None and not self._warned_stale:
                self._warned_stale = True
                log.warning(
                    "the loader workers' vision plan was made for attention %r and %d grid rows, the tower runs %r "
                    "with %d: planning on the training step's host instead (slower, same values)",
                    host_plan["attn"],
                    len(host_plan["rows"]),
                    attn,
                    len(rows),
                )
            kwargs = plan_kwargs(self.visual, torch.tensor(rows, dtype=torch.long).reshape(-1, 3), device)
        self._plans[id(grid)] = _Plan(grid, kwargs)

    def prepare_batch(self, inputs: dict, host_grids: dict | None, host_plans: dict | None = None) -> dict:
        """Plan the image and video calls of `model(**inputs)` from the batch's host grids (`HOST_GRIDS`; none: no
        plan, transformers derives everything itself), taking the loader workers' plans where the batch has
        them (`HOST_PLANS`: the step's host then only copies them). Returns `inputs`, where a planned grid is
        replaced by its host tensor when the inputs carry `position_ids`: the tower then reads nothing from it
        (every value it would derive is in the plan), transformers derives no positions from it, and
        `get_image_features`' split sizes (`grid.prod(-1).tolist()`) are read on the host instead of with a
        device sync."""
        self.clear()
        inputs = dict(inputs)
        for key in GRID_KEYS:
            rows = (host_grids or {}).get(key)
            if inputs.get(key) is None or rows is None:
                continue
            if inputs.get("position_ids") is not None:
                inputs[key] = torch.tensor(rows, dtype=torch.long).reshape(-1, 3)
            self.prepare(inputs[key], rows, (host_plans or {}).get(key))
        return inputs

    def constant(self, grid: torch.Tensor, host_rows) -> None:
        """Plan the call with `grid`, a fixed tensor (the dummy image's) equal to `host_rows`, for every later
        forward; planned again only when `grid` is another tensor (the module moved to another device) or the
        tower's attention implementation changed (it decides whether there are max seqlens)."""
        plan = self._constants.get(id(grid))
        attn = self.visual.config._attn_implementation
        if plan is None or plan.grid is not grid or plan.attn != attn:
            host = torch.tensor(host_rows, dtype=torch.long).reshape(-1, 3)
            kwargs = plan_kwargs(self.visual, host, _tower_device(self.visual, grid))
            self._constants = {id(grid): _Plan(grid, kwargs, attn)}

    def clear(self) -> None:
        self._plans = {}

    def remove(self) -> None:
        self._hook.remove()
        self._plans, self._constants = {}, {}

    def _inject(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        grid = kwargs["grid_thw"] if "grid_thw" in kwargs else (args[1] if len(args) > 1 else None)
        plan = self._plans.get(id(grid)) or self._constants.get(id(grid))
        if plan is None or plan.grid is not grid:
            return None
        return args, {**plan.kwargs, **kwargs}  # a value the caller passed itself wins


def _tower_device(visual: nn.Module, grid: torch.Tensor) -> torch.device:
    """The device the tower computes on: its parameters' (the grid may be a host tensor)."""
    param = next(visual.parameters(), None)
    return param.device if param is not None else grid.device
