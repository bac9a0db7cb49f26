"""The optimizer step: one module call per micro-batch (model + loss), the loss normalised by the global count of
label tokens across micro-batches and ranks, gradients clipped, no host sync; and the held-out evaluation.

`TrainModule` puts the HF model and the loss in one forward, so DDP/FSDP2 see exactly one module call per
micro-step; where ranks must make the same vision-tower calls, a pack that lacks images or videos sends a dummy
image through the tower in their place (VisionAlignment). The loss is trainer/loss.py's fused lm_head +
cross-entropy: the (T, V) logits and their gradient are never materialised.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Literal

import torch
from accelerate import Accelerator
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from data.pipeline import STEP_VISION
from data.processing import IGNORE_INDEX
from modeling import context_parallel, packed, vision_plan
from trainer.loss import linear_cross_entropy

PHASE = "phase/"
"""Prefix of the step's phase annotations (data wait, forward, backward, ...): free without a profiler; under one
they let scripts/profile_step.py say in which phase the GPU sat idle."""
PADDED_MODEL_KEYS = (*packed.MODEL_KEYS, "attention_mask")  # a padded batch: the pack's keys plus its mask
VISION_KINDS = ("pixel_values", "pixel_values_videos")  # the model calls the vision tower once per kind present

VisionAlignment = Literal["every_kind", "step_kinds", "any_call"]
"""Which vision-tower calls a pack makes beyond its own (each extra one a dummy image contributing exactly 0):
- every_kind: one per kind, always (two calls per pack), for a caller that knows nothing of its ranks;
- step_kinds: one per kind that any rank's pack of the micro-step holds (the batch's STEP_VISION; every_kind
  without it): FSDP2 all-gathers per call, unit by unit, so the ranks' calls must pair up;
- any_call: one dummy for a pack with no image and no video, else none (one process, DDP).
Every pack makes at least one call, so every vision parameter gets a gradient (0 for a text-only pack) in every
step, whatever the layout: AdamW steps a zero gradient (momentum, weight decay) but skips a missing one, so one GPU,
DDP and FSDP2 train the same weights only if no layout leaves the gradient out (DDP's reducer also needs it).
A dummy call is a whole tower forward and backward of tiny kernels that the GPU waits for (docs/performance.md), so a
layout makes no more of them than its ranks need."""


def mixed_precision(dtype: str) -> str:
    """accelerate's `mixed_precision` for `model.dtype`: weights stay fp32 (the optimizer's master copy), matmuls
    run in the recipe dtype under autocast."""
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "no"}[dtype]


def _tensor_sum(value: Any) -> torch.Tensor | None:
    """Sum of every floating tensor in a (nested) model output; None when there is none."""
    if isinstance(value, torch.Tensor):
        return value.float().sum() if value.is_floating_point() else None
    if isinstance(value, dict) or hasattr(value, "to_tuple"):
        value = list(value.values())
    if isinstance(value, list | tuple):
        sums = [s for s in (_tensor_sum(v) for v in value) if s is not None]
        return torch.stack(sums).sum() if sums else None
    return None


def labelled_rows(batch: dict) -> torch.Tensor:
    """The batch's `label_rows` (data/collate.py): long (n,), the rows of the flattened hidden states that have a
    label. ValueError for a batch made without them (counting them here would read the device)."""
    rows = batch.get("label_rows")
    if rows is None:
        raise ValueError("the batch has no label_rows: build it with data/collate.py (label_rows(shift_labels)).")
    return rows


class TrainModule(nn.Module):
    """HF model + summed cross-entropy in one forward.

    forward(batch) -> fp32 scalar: Σ over label tokens of -log p(target), from the base model's last hidden states
    (1, T, H) (or (B, S, H) padded), the lm_head weight and `shift_labels`, by `linear_cross_entropy` (no HF
    logits, no HF loss) over the labelled rows only (`label_rows`, planned on the host): a row without a label adds
    nothing to the loss and gets a zero gradient either way, so the lm_head multiplies just those rows (what share
    of a pack that is, and the time it saves: docs/performance.md, "Only the labelled rows"). The caller divides by
    the global label count.

    The base model (`model.model`) gets the keywords the HF *ForConditionalGeneration.forward would pass it, and
    the six families' forward is only `lm_head(hidden_states)` on top (no bias, no logit scaling or softcapping).
    The MoE families' router auxiliary loss, which HF adds to its own loss only when given labels, is not part of
    this loss (HF also asks the base model for router logits when the config's `output_router_logits` is set;
    nothing here reads them).
    """

    def __init__(self, model: nn.Module, vision_alignment: VisionAlignment = "every_kind"):
        super().__init__()
        if getattr(model.lm_head, "bias", None) is not None:
            raise ValueError("the fused lm_head + cross-entropy takes no bias, but this model's lm_head has one.")
        self.model = model
        self.vision_alignment = vision_alignment
        # FSDP2 auto-wrapping reads the layer classes to shard from the root module.
        self._no_split_modules = getattr(model, "_no_split_modules", None)
        vision = model.config.vision_config
        merge = vision.spatial_merge_size
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        # The smallest valid image: one temporal step, merge x merge patches → one merged token.
        self.register_buffer("dummy_pixels", torch.zeros(merge * merge, patch_dim), persistent=False)
        self.register_buffer("dummy_grid", torch.tensor([[1, merge, merge]]), persistent=False)
        self._dummy_rows = ((1, merge, merge),)
        # The tower's grid metadata, computed on the host from the batch's host grids (modeling/vision_plan.py).
        self.vision_plans = vision_plan.VisionPlans(model.model.visual)

    def model_inputs(self, batch: dict) -> dict:
        if context_parallel.is_sharded(batch):
            inputs = packed.packed_model_inputs(self.model, batch)
            inputs["mm_encoder_outputs"] = context_parallel.vision_features(
                self.model, batch, self.dummy_pixels, self.dummy_grid
            )
            return inputs
        if packed.is_packed_batch(batch):
            return packed.packed_model_inputs(self.model, batch)
        return {key: batch[key] for key in PADDED_MODEL_KEYS if batch.get(key) is not None}

    def dummy_vision_calls(self, batch: dict) -> int:
        """How many dummy images this pack sends through the vision tower (VisionAlignment)."""
        missing = [not context_parallel.has_vision(batch, key) for key in VISION_KINDS]
        if self.vision_alignment == "any_call":
            return int(all(missing))
        if self.vision_alignment == "step_kinds" and STEP_VISION in batch:
            calls = sum(absent and any_rank for absent, any_rank in zip(missing, batch[STEP_VISION], strict=True))
            return max(calls, int(all(missing)))  # no rank holds any vision input: every rank makes one dummy
        return sum(missing)

    def forward(self, batch: dict) -> torch.Tensor:
        # Dummies run first, where a real image would: FSDP2 all-gathers unit by unit, in execution order. Under
        # context parallelism a rank owning none of the pack's images runs its dummy in vision_features instead.
        visual = self.model.model.visual
        with record_function(PHASE + "vision_dummies"):
            self.vision_plans.constant(self.dummy_grid, self._dummy_rows)
            dummies = [
                _tensor_sum(visual(self.dummy_pixels.to(visual.dtype), grid_thw=self.dummy_grid))
                for _ in range(self.dummy_vision_calls(batch))
            ]
        with record_function(PHASE + "vision_plan"):
            inputs = self.vision_plans.prepare_batch(
                self.model_inputs(batch), batch.get(vision_plan.HOST_GRIDS), batch.get(vision_plan.HOST_PLANS)
            )
        with record_function(PHASE + "model_forward"):
            hidden = self.model.model(**inputs, use_cache=False).last_hidden_state
        self.vision_plans.clear()
        with record_function(PHASE + "loss"):
            # Read here, not before: under FSDP2 the root unit's parameters are the unsharded ones only inside forward.
            weight = self.model.lm_head.weight
            labels = batch["shift_labels"].flatten()
            loss_sum = linear_cross_entropy(hidden.flatten(0, 1), weight, labels, rows=labelled_rows(batch))
        return loss_sum + 0.0 * sum(dummies) if dummies else loss_sum


def to_device(batch: dict, device: torch.device) -> dict:
    """Tensors to `device`; Python values (counts, lengths) stay on the host. Non-blocking: asynchronous from
    pinned memory (the Prefetcher pins on CUDA), so the host never waits for the copy. The vision grids are also
    kept as host ints (`vision_plan.HOST_GRIDS`), for TrainModule's vision plans."""
    out = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    if vision_plan.HOST_PLANS in batch:  # the loader workers' vision plans (their rows and ints stay on the host)
        out[vision_plan.HOST_PLANS] = vision_plan.host_plans_to(batch[vision_plan.HOST_PLANS], device)
    return {**out, vision_plan.HOST_GRIDS: vision_plan.host_grids(batch)}


def accumulate_gradients(
    accelerator: Accelerator, module: nn.Module, micro_batches: list[dict]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward + backward of one optimizer step's micro-batches (already on the device).

    The loss of micro-batch j is Σ_j CE / N, N = label tokens over all micro-batches of all ranks, so the
    accumulated gradient is exactly the gradient of the mean token loss of the global batch, however tokens are
    spread over micro-batches and ranks. N is counted on the device from `shift_labels` (a host-made tensor would
    need a blocking copy) and all-reduced once: no host sync. DDP/FSDP average gradients over ranks, so the loss is
    multiplied by the world size to turn that average back into the sum.
    Returns (summed CE over this rank's micro-batches, this rank's label count) as detached device scalars.
    """
    local_count = sum((b["shift_labels"] != IGNORE_INDEX).sum(dtype=torch.float32) for b in micro_batches)
    global_count = (
        accelerator.reduce(local_count.clone(), reduction="sum") if accelerator.num_processes > 1 else local_count
    )
    scale = accelerator.num_processes / global_count.clamp(min=1.0)
    loss_total = torch.zeros((), device=accelerator.device)
    for j, batch in enumerate(micro_batches):
        last = j == len(micro_batches) - 1
        with contextlib.nullcontext() if last else accelerator.no_sync(module):
            loss_sum = module(batch)
            with record_function(PHASE + "backward"):
                accelerator.backward(loss_sum * scale)
        loss_total += loss_sum.detach()
    return loss_total, local_count


def optimizer_step(
    accelerator: Accelerator,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    params: list[nn.Parameter],
    host_batches: list[dict],
    max_grad_norm: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step over `host_batches` (its `train.grad_accum_steps` micro-batches, still on the host):
    copy to the device, forward + backward (`accumulate_gradients`), clip `params` (the trainable ones) to
    `max_grad_norm` (0: measure the norm, clip nothing), optimizer and scheduler step, gradients dropped. No host sync.
    Returns (summed CE over this rank's micro-batches, this rank's label count, the gradient norm before clipping)
    as detached fp32 device scalars.
    """
    with record_function(PHASE + "to_device"):
        micro = [to_device(b, accelerator.device) for b in host_batches]
    loss_sum, label_count = accumulate_gradients(accelerator, module, micro)
    with record_function(PHASE + "clip"):
        grad_norm = accelerator.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
    if isinstance(grad_norm, DTensor):  # FSDP2: a replicated DTensor, which cannot be added to a plain tensor
        grad_norm = grad_norm.full_tensor()
    with record_function(PHASE + "optimizer"):
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return loss_sum, label_count, grad_norm.detach().float()


@torch.no_grad()
def evaluate(accelerator: Accelerator, module: nn.Module, loader, max_batches: int, start_state: dict) -> float:
    """Mean token loss over the first `max_batches` held-out batches of every rank (one sync at the end); the
    loader is rewound to `start_state` first, so every evaluation sees the same batches."""
    loader.load_state_dict(start_state)
    module.eval()
    sums = torch.zeros(2, device=accelerator.device)
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        sums[0] += module(to_device(batch, accelerator.device))
        sums[1] += batch["num_label_tokens"]
    module.train()
    sums = accelerator.reduce(sums, reduction="sum")
    return (sums[0] / sums[1].clamp(min=1.0)).item()
