"""The training loss: lm_head matmul and summed cross-entropy fused, chunk by chunk, so the logits never exist whole.

Memory: unfused, a pack of T = 16384 tokens over Qwen's V = 151936 vocabulary holds its bf16 logits (T·V·2 bytes,
4.98 GB) from forward to backward, and backward builds their bf16 gradient (as many bytes again) before the lm_head
matmuls consume it. `linear_cross_entropy` instead walks the rows in chunks; for each chunk it computes the logits,
the loss and at once the gradients of the hidden states and of the weight, and drops the logits (Liger-Kernel's fused
linear cross-entropy). What it holds until backward is those two gradients, (T, H) and (V, H), instead of the logits
and the bf16 copies of the hidden states and weight that nn.Linear saves. Given the rows that have a label (the
collator plans them on the host), it multiplies only those: on vision data most rows are image, video or prompt
tokens without one, each of which would cost the three matmuls for a zero.
Compute: backward only scales the stored gradients by the incoming scalar, so the work is the same three matmuls as
unfused (logits, gradient of the input, gradient of the weight), none recomputed.

Two paths, one arithmetic (the logits rounded to the matmul dtype, softmax in fp32, its gradient rounded back once):
- CUDA: a chunk's logits (matmul dtype, at most CE_KERNEL_CHUNK_ELEMENTS) become their own gradient in place
  (modeling/loss_kernel.py, two reads and one write), and the weight gradient accumulates in fp32 inside the matmul
  (cuBLAS with an fp32 output, C += A·B), once per chunk. The torch steps below instead make an fp32 copy of each
  chunk's logits and pass over it seven times, and each chunk adds a bf16 weight-gradient partial into the fp32 sum,
  a read-modify-write as large as the lm_head in fp32 (docs/performance.md has what that costs at Qwen3.5's
  V = 248320).
- elsewhere (CPU): the same steps in torch ops on an fp32 copy of at most CE_CHUNK_ELEMENTS logits.
"""

from __future__ import annotations

import torch

from data.processing import IGNORE_INDEX
from modeling.loss_kernel import cross_entropy_grad_

CE_CHUNK_ELEMENTS = 2**28  # torch path: the fp32 logits of a chunk take 1 GiB, whatever the vocabulary
# CUDA path: a chunk's logits in the matmul dtype (2 GiB in bf16; 4,324 rows at V = 248320). Fewer, larger chunks
# mean fewer read-modify-writes of the fp32 (V, H) weight-gradient sum, each as large as the lm_head in fp32.
CE_KERNEL_CHUNK_ELEMENTS = 2**30


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would multiply in: autocast's when it is on (fp32 master weights, bf16 matmuls), else
    the inputs' own, which must then agree (as F.linear requires)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden states are {hidden.dtype} but the weight is {weight.dtype}, outside autocast.")
    return weight.dtype


def _softmax_in_kernel(device: torch.device) -> bool:
    """Whether a chunk's softmax gradient runs in modeling/loss_kernel.py (else in torch ops)."""
    return device.type == "cuda"


def _matmul_accumulates_in_fp32(device: torch.device) -> bool:
    """Whether a low-precision matmul can add its product into an fp32 sum itself (cuBLAS; not on the CPU)."""
    return device.type == "cuda"


def _chunk_elements(device: torch.device) -> int:
    return CE_KERNEL_CHUNK_ELEMENTS if _softmax_in_kernel(device) else CE_CHUNK_ELEMENTS


def cross_entropy_grad_torch_(logits: torch.Tensor, labels: torch.Tensor, write_grad: bool) -> torch.Tensor:
    """`cross_entropy_grad_` in torch ops: each row's loss (fp32, (n,)) and, if `write_grad`, the logits overwritten
    with their gradient softmax - onehot(label) (zero rows where the label is ignored), else left as they are.
    One fp32 (n, V) buffer (the logits themselves when they are fp32 and get the gradient), turned in place into
    exp(logits - max), then into the gradient."""
    is_target = labels != IGNORE_INDEX
    targets = torch.where(is_target, labels, 0).unsqueeze(1)
    probs = logits.to(torch.float32, copy=not write_grad)
    target_logits = probs.gather(1, targets).squeeze(1)
    row_max = probs.amax(dim=1, keepdim=True)
    probs.sub_(row_max).exp_()
    row_sum = probs.sum(dim=1, keepdim=True)
    row_loss = torch.where(is_target, (row_sum.log() + row_max).squeeze(1) - target_logits, 0.0)
    if write_grad:
        probs.div_(row_sum).mul_(is_target.unsqueeze(1))
        probs.scatter_add_(1, targets, -is_target.to(probs.dtype).unsqueeze(1))
        if probs is not logits:
            logits.copy_(probs)
    return row_loss


def _add_weight_grad(total: torch.Tensor | None, grad_logits: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """total + grad_logits.T @ chunk in fp32 (total None: the first chunk's term). On CUDA a low-precision product
    accumulates into the fp32 sum inside the matmul; elsewhere its partial is rounded to the matmul dtype and added."""
    low_precision = grad_logits.dtype != torch.float32
    if low_precision and _matmul_accumulates_in_fp32(grad_logits.device):
        if total is None:
            return torch.mm(grad_logits.T, chunk, out_dtype=torch.float32)
        return torch.addmm(total, grad_logits.T, chunk, out_dtype=torch.float32, out=total)
    if total is None:
        return (grad_logits.T @ chunk).float()
    if low_precision:
        return total.add_(grad_logits.T @ chunk)
    return total.addmm_(grad_logits.T, chunk)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the summed loss and, when asked, both gradients; backward scales them by grad_output."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        kept_rows: torch.Tensor | None,
        matmul_dtype: torch.dtype,
        chunk_rows: int,
        grad_hidden_wanted: bool,
        grad_weight_wanted: bool,
    ) -> torch.Tensor:
        ctx.positions = hidden.shape[0]
        if kept_rows is not None:
            hidden, labels = hidden.index_select(0, kept_rows), labels.index_select(0, kept_rows)
        # Autocast off: every cast is explicit, and the weight gradient's products stay in the matmul dtype until
        # they reach the fp32 sum.
        want_grad = grad_hidden_wanted or grad_weight_wanted
        with torch.autocast(hidden.device.type, enabled=False):
            weight_mm = weight.to(matmul_dtype)
            row_loss = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if grad_hidden_wanted else None
            grad_weight = None
            for start in range(0, hidden.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                chunk = hidden[rows].to(matmul_dtype)
                logits = chunk @ weight_mm.T  # becomes its own gradient below
                if _softmax_in_kernel(logits.device):
                    row_loss[rows] = cross_entropy_grad_(logits, labels[rows], IGNORE_INDEX, want_grad)
                else:
                    row_loss[rows] = cross_entropy_grad_torch_(logits, labels[rows], want_grad)
                if grad_hidden_wanted:
                    grad_hidden[rows] = logits @ weight_mm
                if grad_weight_wanted:
                    grad_weight = _add_weight_grad(grad_weight, logits, chunk)
                del logits  # before the next chunk's logits are allocated
            if grad_weight_wanted and grad_weight is None:  # no rows at all
                grad_weight = torch.zeros_like(weight)
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), kept_rows)
        if kept_rows is not None:  # summed among the other positions' zeros: the same fp32 additions as over all
            row_loss = row_loss.new_zeros(ctx.positions).index_copy_(0, kept_rows, row_loss)
        return row_loss.sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # In place: the stored gradients are used once (a second backward fails the saved-tensor version check).
        grad_hidden, grad_weight, kept_rows = ctx.saved_tensors
        grad_hidden = None if grad_hidden is None else grad_hidden.mul_(grad_output)
        if grad_hidden is not None and kept_rows is not None:  # the skipped rows' gradient: exact zeros
            full = grad_hidden.new_zeros(ctx.positions, grad_hidden.shape[1])
            grad_hidden = full.index_copy_(0, kept_rows, grad_hidden)
        grad_weight = None if grad_weight is None else grad_weight.mul_(grad_output)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_rows: int | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ over label tokens of -log softmax(hidden @ weight.T)[label], in fp32, the (N, V) logits never whole.

    hidden: (N, H) final hidden states, any float dtype; weight: (V, H) the lm_head weight (fp32 master under
    autocast, possibly tied to the input embeddings: autograd adds the two gradients); labels: long (N,),
    IGNORE_INDEX where no target (those rows add 0 to the loss and get a zero gradient).
    chunk_rows: rows per chunk (default CE_KERNEL_CHUNK_ELEMENTS / V on CUDA, 7,067 rows for V = 151936;
    CE_CHUNK_ELEMENTS / V elsewhere, 1,766).
    rows: long (n,), ascending, on hidden's device: the rows that have a label (data/collate.py's `label_rows`,
    planned on the host); only they are multiplied by the lm_head. Every other row must be IGNORE_INDEX. None: all
    N rows. A skipped row adds an exact 0 to the loss (kept in its place in the sum, which so adds in the same
    order) and gets a zero gradient: the loss is that of all N rows bit for bit, and in fp32 on the CPU so are both
    gradients when the rows are one chunk (over several, each chunk's matmuls hold other rows: fp32 rounding).
    Returns an fp32 scalar. The matmuls run in the dtype nn.Linear would use (autocast's, when on); softmax and loss
    in fp32; the weight gradient is accumulated over chunks in fp32 and returned in `weight`'s dtype, the hidden
    gradient in `hidden`'s. Gradients are computed in forward, only for inputs that need one (none under no_grad);
    they are held until backward: (n, H) in `hidden`'s dtype plus (V, H) in `weight`'s, in place of the logits.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden (N, H), weight (V, H), labels (N,); got {tuple(hidden.shape)}, {tuple(weight.shape)}, "
            f"{tuple(labels.shape)}."
        )
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.long):
        raise ValueError(f"rows must be a long (n,) tensor of row indices, got {rows.dtype} {tuple(rows.shape)}.")
    grad_enabled = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(
        hidden,
        weight,
        labels,
        rows,
        _matmul_dtype(hidden, weight),
        chunk_rows or max(1, _chunk_elements(hidden.device) // weight.shape[0]),
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
    )
