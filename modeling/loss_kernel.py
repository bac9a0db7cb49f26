"""Cross-entropy's logits gradient, written in place over the logits, with each row's loss (Triton).

For a block of logits (n, V) in the matmul dtype and labels (n,), one program per row streams the row twice: an
online max and sum of exponentials in fp32, then softmax - onehot(label) over the same storage, in the logits'
dtype; a row whose label is ignored gets a zero gradient and loss 0. This is the arithmetic of trainer/loss.py's
torch path (softmax of the rounded logits in fp32, the gradient rounded back once), in two reads and one write of
the logits instead of that path's fp32 copy and seven passes over it. trainer/loss.py calls it on CUDA tensors; the
tests run it under Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # columns per iteration: 8 KiB of bf16 per row and pass, 8 warps


@triton.jit
def _cross_entropy_grad_kernel(
    LOGITS,
    LABELS,
    ROW_LOSS,
    stride_row,
    n_cols,
    ignore_index,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    cols = tl.arange(0, BLOCK)
    # Per-lane running max and sum of exp(x - max); lanes that have seen only masked columns stay at -inf / 0.
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no inf - inf while a lane is all masked
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    row_sum = tl.sum(lane_sum * tl.exp(lane_max - row_max), axis=0)

    label = tl.load(LABELS + row)
    is_target = label != ignore_index
    target = tl.where(is_target, label, 0)
    target_logit = tl.load(base + target).to(tl.float32)
    row_loss = tl.log(row_sum) + row_max - target_logit
    tl.store(ROW_LOSS + row, tl.where(is_target, row_loss, 0.0))
    if WRITE_GRAD:
        for start in range(0, n_cols, BLOCK):
            col = start + cols
            mask = col < n_cols
            x = tl.load(base + col, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - row_max) / row_sum - tl.where(col == target, 1.0, 0.0)
            grad = tl.where(is_target, grad, 0.0)
            tl.store(base + col, grad.to(LOGITS.dtype.element_ty), mask=mask)


def cross_entropy_grad_(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, write_grad: bool
) -> torch.Tensor:
    """Each row's cross-entropy loss (fp32, (n,); 0 where the label is `ignore_index`) of logits (n, V), rows
    contiguous; with `write_grad`, the logits are overwritten with the loss's gradient softmax - onehot(label) (zero
    rows where ignored), in their own dtype. Labels must lie in [0, V) or equal `ignore_index` (not checked here)."""
    if logits.dim() != 2 or logits.stride(1) != 1 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits (n, V) with contiguous rows and labels (n,); got {tuple(logits.shape)} with strides "
            f"{logits.stride()} and labels {tuple(labels.shape)}."
        )
    row_loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if logits.shape[0]:
        block = min(_BLOCK, triton.next_power_of_2(logits.shape[1]))
        _cross_entropy_grad_kernel[(logits.shape[0],)](
            logits, labels, row_loss, logits.stride(0), logits.shape[1], ignore_index,
            WRITE_GRAD=write_grad, BLOCK=block, num_warps=8,
        )  # fmt: skip
    return row_loss
