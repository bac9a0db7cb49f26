"""The optimizer step: one module call per micro-batch (model + loss), the loss normalised by the global count of
label tokens across micro-batches and ranks, gradients clipped, no host sync; and the held-out evaluation.

`TrainModule` puts the HF model and the loss in one forward, so DDP/FSDP2 see exactly one module call per
micro-step and every rank runs the vision tower twice every step, for images and for videos (a pack without one
or the other sends a dummy image through it in its place).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from data.processing import IGNORE_INDEX
from training import context_parallel, packed

CE_CHUNK_ELEMENTS = 2**28  # fp32 logits live one chunk at a time: 1 GiB, whatever the vocabulary
PADDED_MODEL_KEYS = (*packed.MODEL_KEYS, "attention_mask")  # a padded batch: the pack's keys plus its mask


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


def _chunk_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
    """Σ over label tokens of -log softmax(logits)[label], in fp32, without a full fp32 copy of the logits.

    logits: (N, V) in the compute dtype (bf16 under autocast); labels: long (N,), IGNORE_INDEX where no target.
    Returns an fp32 scalar. Each chunk of `chunk_tokens` rows (default: CE_CHUNK_ELEMENTS / V) is upcast, reduced
    and dropped; backward recomputes it (activation checkpointing), so the fp32 log-probabilities of a 16k x 152k
    pack (~10 GB, plus as much again for their gradient) never exist at once.
    """
    chunk = chunk_tokens or max(1, CE_CHUNK_ELEMENTS // logits.shape[-1])
    if logits.shape[0] <= chunk:
        return _chunk_cross_entropy(logits, labels)
    sums = [
        checkpoint(_chunk_cross_entropy, part, part_labels, use_reentrant=False)
        for part, part_labels in zip(logits.split(chunk), labels.split(chunk))
    ]
    return torch.stack(sums).sum()


class TrainModule(nn.Module):
    """HF model + summed cross-entropy in one forward.

    forward(batch) -> fp32 scalar: Σ over label tokens of -log p(target), computed from the model's logits
    (1, T, V) (or (B, S, V) padded) and `shift_labels` by `summed_cross_entropy` (no HF loss, no full fp32 copy of
    the logits). The caller divides by the global label count.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        # FSDP2 auto-wrapping reads the layer classes to shard from the root module.
        self._no_split_modules = getattr(model, "_no_split_modules", None)
        vision = model.config.vision_config
        merge = vision.spatial_merge_size
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        # The smallest valid image: one temporal step, merge x merge patches → one merged token.
        self.register_buffer("dummy_pixels", torch.zeros(merge * merge, patch_dim), persistent=False)
        self.register_buffer("dummy_grid", torch.tensor([[1, merge, merge]]), persistent=False)

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

    def forward(self, batch: dict) -> torch.Tensor:
        # The model calls the vision tower once for a pack's images and once for its videos. Every rank must make
        # the same calls (FSDP2 all-gathers per call, DDP needs every vision parameter used), so a pack without
        # images or without videos sends a dummy image through the tower in their place (contributing exactly 0).
        # Dummies run first, where a real image would: FSDP2 all-gathers unit by unit, in execution order. Under
        # context parallelism a rank owning none of the pack's images runs its dummy in vision_features instead.
        visual = self.model.model.visual
        dummies = [
            _tensor_sum(visual(self.dummy_pixels.to(visual.dtype), grid_thw=self.dummy_grid))
            for key in ("pixel_values", "pixel_values_videos")
            if not context_parallel.has_vision(batch, key)
        ]
        logits = self.model(**self.model_inputs(batch), use_cache=False).logits
        loss_sum = summed_cross_entropy(logits.flatten(0, 1), batch["shift_labels"].flatten())
        return loss_sum + 0.0 * sum(dummies) if dummies else loss_sum


def to_device(batch: dict, device: torch.device) -> dict:
    """Tensors to `device`; Python values (counts, lengths) stay on the host. Non-blocking: asynchronous from
    pinned memory (the Prefetcher pins on CUDA), so the host never waits for the copy."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


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
    micro = [to_device(b, accelerator.device) for b in host_batches]
    loss_sum, label_count = accumulate_gradients(accelerator, module, micro)
    grad_norm = accelerator.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
    if isinstance(grad_norm, DTensor):  # FSDP2: a replicated DTensor, which cannot be added to a plain tensor
        grad_norm = grad_norm.full_tensor()
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
