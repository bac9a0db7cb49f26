"""The training loss: lm_head matmul and summed cross-entropy fused, chunk by chunk, so the logits never exist whole.

Memory: unfused, a pack of T = 16384 tokens over Qwen's V = 151936 vocabulary holds its bf16 logits (T·V·2 bytes,
4.98 GB) from forward to backward, and backward builds their bf16 gradient (as many bytes again) before the lm_head
matmuls consume it. `linear_cross_entropy` instead walks the rows in chunks whose fp32 logits take at most
`CE_CHUNK_ELEMENTS`; for each chunk it computes the logits, the loss and at once the gradients of the hidden states
and of the weight, and drops the logits (Liger-Kernel's fused linear cross-entropy, in plain PyTorch). What it holds
until backward is those two gradients, (T, H) and (V, H), instead of the logits and the bf16 copies of the hidden
states and weight that nn.Linear saves.
Compute: backward only scales the stored gradients by the incoming scalar, so the work is the same three matmuls as
unfused (logits, gradient of the input, gradient of the weight), none recomputed.
"""

from __future__ import annotations

import torch

from data.processing import IGNORE_INDEX

CE_CHUNK_ELEMENTS = 2**28  # fp32 logits live one chunk at a time: 1 GiB, whatever the vocabulary


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would multiply in: autocast's when it is on (fp32 master weights, bf16 matmuls), else
    the inputs' own, which must then agree (as F.linear requires)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden states are {hidden.dtype} but the weight is {weight.dtype}, outside autocast.")
    return weight.dtype


def _chunk_loss(
    chunk: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, want_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed loss of one chunk and, if `want_grad`, its logits' gradient softmax - onehot(label) (zero rows where
    the label is ignored), in the matmul dtype. chunk (n, H) and weight (V, H) in the matmul dtype, labels (n,).
    One fp32 (n, V) buffer, turned in place into exp(logits - max), then into the gradient."""
    is_target = labels != IGNORE_INDEX
    targets = torch.where(is_target, labels, 0).unsqueeze(1)
    probs = (chunk @ weight.T).float()
    target_logits = probs.gather(1, targets).squeeze(1)
    row_max = probs.amax(dim=1, keepdim=True)
    probs.sub_(row_max).exp_()
    row_sum = probs.sum(dim=1, keepdim=True)
    row_loss = (row_sum.log() + row_max).squeeze(1) - target_logits
    loss = torch.where(is_target, row_loss, 0.0).sum()
    if not want_grad:
        return loss, None
    probs.div_(row_sum).mul_(is_target.unsqueeze(1))
    probs.scatter_add_(1, targets, -is_target.to(probs.dtype).unsqueeze(1))
    return loss, probs.to(chunk.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the summed loss and, when asked, both gradients; backward scales them by grad_output."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        matmul_dtype: torch.dtype,
        chunk_rows: int,
        grad_hidden_wanted: bool,
        grad_weight_wanted: bool,
    ) -> torch.Tensor:
        # Autocast off: every cast is explicit, and the weight-gradient partials stay in the matmul dtype until
        # they are added to the fp32 accumulator.
        with torch.autocast(hidden.device.type, enabled=False):
            weight_mm = weight.to(matmul_dtype)
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if grad_hidden_wanted else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if grad_weight_wanted else None
            for start in range(0, hidden.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                chunk = hidden[rows].to(matmul_dtype)
                chunk_loss, grad_logits = _chunk_loss(
                    chunk, weight_mm, labels[rows], grad_hidden_wanted or grad_weight_wanted
                )
                loss += chunk_loss
                if grad_hidden_wanted:
                    grad_hidden[rows] = grad_logits @ weight_mm
                if grad_weight_wanted:
                    grad_weight += grad_logits.T @ chunk
                del grad_logits  # before the next chunk's logits are allocated
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        # In place: the stored gradients are used once (a second backward fails the saved-tensor version check).
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = None if grad_hidden is None else grad_hidden.mul_(grad_output)
        grad_weight = None if grad_weight is None else grad_weight.mul_(grad_output)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_rows: int | None = None
) -> torch.Tensor:
    """Σ over label tokens of -log softmax(hidden @ weight.T)[label], in fp32, the (N, V) logits never whole.

    hidden: (N, H) final hidden states, any float dtype; weight: (V, H) the lm_head weight (fp32 master under
    autocast, possibly tied to the input embeddings: autograd adds the two gradients); labels: long (N,),
    IGNORE_INDEX where no target (those rows add 0 to the loss and get a zero gradient).
    chunk_rows: rows per chunk (default CE_CHUNK_ELEMENTS / V, ~1766 rows for V = 151936).
    Returns an fp32 scalar. The matmuls run in the dtype nn.Linear would use (autocast's, when on); softmax and loss
    in fp32; the weight gradient is accumulated over chunks in fp32 and returned in `weight`'s dtype, the hidden
    gradient in `hidden`'s. Gradients are computed in forward, only for inputs that need one (none under no_grad);
    they are held until backward: (N, H) in `hidden`'s dtype plus (V, H) in `weight`'s, in place of the logits.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden (N, H), weight (V, H), labels (N,); got {tuple(hidden.shape)}, {tuple(weight.shape)}, "
            f"{tuple(labels.shape)}."
        )
    grad_enabled = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(
        hidden,
        weight,
        labels,
        _matmul_dtype(hidden, weight),
        chunk_rows or max(1, CE_CHUNK_ELEMENTS // weight.shape[0]),
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
    )
