"""Public rotary ops: input validation, dispatch, autograd and `torch.library` registration.

`apply_mrope` / `apply_vision_rope` validate their inputs (ValueError saying how to fix them), then rotate:
- out-of-place (default): under torch.compile the custom op `mrope_kernels::rope` (fake impl + `register_autograd`,
  so `fullgraph=True` traces it); in eager mode its twin autograd.Function, which runs the same kernels without
  the dispatcher's per-call host cost;
- `inplace=True`: an autograd.Function that rotates lanes [0, R) of q and k in place (the mutating custom op
  `mrope_kernels::rope_` under torch.compile) and marks them dirty; for views that need gradients (autograd cannot
  mark two views dirty from one Function) the out-of-place rotation is written back into the rotary lanes.
Every backward is the forward kernel with the angle negated (CONJUGATE); only positions and inv_freq are saved.

Dispatch: CUDA tensors run the Triton kernel; CPU tensors run it under TRITON_INTERPRET=1, otherwise the
plain-PyTorch reference (`mrope_kernels.reference`) with the same math.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from mrope_kernels import triton_rope
from mrope_kernels.reference import apply_mrope_reference, apply_vision_rope_reference

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_POSITION_DTYPES = (torch.int64, torch.int32)
_NO_SECTIONS = [0, 0, 0]


def runs_triton(device: torch.device) -> bool:
    """Whether rotations on `device` run the Triton kernels (else the plain-PyTorch reference, same math)."""
    return device.type == "cuda" or (device.type == "cpu" and triton_rope.RUNS_IN_INTERPRETER)


def _runs_triton(x: torch.Tensor) -> bool:
    return runs_triton(x.device)


def _rotate_into(q, k, q_out, k_out, positions, inv_freq, layout, sections, scaling, conjugate) -> None:
    """Rotate q, k into q_out, k_out (possibly the same tensors) with whichever backend fits the device."""
    if _runs_triton(q):
        triton_rope.rope_launch(q, k, q_out, k_out, positions, inv_freq, layout, sections, scaling, conjugate)
        return
    # Reference path. Negating integer positions negates the fp32 angle exactly (cos even, sin odd).
    signed_positions = -positions if conjugate else positions
    if layout == triton_rope.LAYOUT_VISION:
        rq, rk = apply_vision_rope_reference(q, k, signed_positions, inv_freq)
    else:
        interleaved = layout == triton_rope.LAYOUT_INTERLEAVED
        rq, rk = apply_mrope_reference(q, k, signed_positions, inv_freq, sections, interleaved, scaling)
    if q_out.data_ptr() == q.data_ptr():
        rotary_dim = _rotary_dim(layout, inv_freq)
        q[..., :rotary_dim].copy_(rq[..., :rotary_dim])
        k[..., :rotary_dim].copy_(rk[..., :rotary_dim])
    else:
        q_out.copy_(rq)
        k_out.copy_(rk)


def _rotated(q, k, positions, inv_freq, layout, sections, scaling, conjugate):
    """Out-of-place rotation into new tensors with q's / k's layout (empty_like keeps transposed strides)."""
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _rotate_into(q, k, q_out, k_out, positions, inv_freq, layout, sections, scaling, conjugate)
    return q_out, k_out


def _contiguous_last_dim(grad: torch.Tensor) -> torch.Tensor:
    # Autograd may hand over expanded (stride-0) or otherwise odd gradients; the kernel needs stride(-1) == 1.
    return grad if grad.stride(-1) == 1 else grad.contiguous()


@torch.library.custom_op("mrope_kernels::rope", mutates_args=())
def _rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    layout: int,
    sections: list[int],
    scaling: float,
    conjugate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place rotation as an opaque op for torch.compile (the eager path skips the dispatcher)."""
    return _rotated(q, k, positions, inv_freq, layout, sections, scaling, conjugate)


@_rope.register_fake
def _rope_fake(q, k, positions, inv_freq, layout, sections, scaling, conjugate):
    return torch.empty_like(q), torch.empty_like(k)


def _rope_setup_context(ctx, inputs, output) -> None:
    _, _, positions, inv_freq, layout, sections, scaling, conjugate = inputs
    ctx.save_for_backward(positions, inv_freq)
    ctx.static_args = (layout, sections, scaling, conjugate)


def _rope_backward(ctx, grad_q, grad_k):
    positions, inv_freq = ctx.saved_tensors
    layout, sections, scaling, conjugate = ctx.static_args
    grad_q, grad_k = _rope(
        _contiguous_last_dim(grad_q), _contiguous_last_dim(grad_k), positions, inv_freq,
        layout, sections, scaling, not conjugate,
    )  # fmt: skip
    return grad_q, grad_k, None, None, None, None, None, None


torch.library.register_autograd("mrope_kernels::rope", _rope_backward, setup_context=_rope_setup_context)


class _RopeFunction(torch.autograd.Function):
    """Eager twin of `mrope_kernels::rope` + its registered autograd: same kernels, no dispatcher round trips.

    The custom-op dispatch costs tens of µs of host time per call (forward and backward), as much as the kernel
    itself at 16k tokens, so eager calls come here and only torch.compile traces go through the op.
    """

    @staticmethod
    def forward(ctx, q, k, positions, inv_freq, layout, sections, scaling):
        ctx.save_for_backward(positions, inv_freq)
        ctx.static_args = (layout, sections, scaling)
        return _rotated(q, k, positions, inv_freq, layout, sections, scaling, False)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernel's backward is not itself differentiable: say so
    def backward(ctx, grad_q, grad_k):
        positions, inv_freq = ctx.saved_tensors
        grad_q, grad_k = _rotated(
            _contiguous_last_dim(grad_q), _contiguous_last_dim(grad_k), positions, inv_freq, *ctx.static_args, True
        )
        return grad_q, grad_k, None, None, None, None, None


@torch.library.custom_op("mrope_kernels::rope_", mutates_args=("q", "k"))
def _rope_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    layout: int,
    sections: list[int],
    scaling: float,
    conjugate: bool,
) -> None:
    """In-place rotation of lanes [0, R) of q and k; lanes [R, D) are neither read nor written."""
    _rotate_into(q, k, q, k, positions, inv_freq, layout, sections, scaling, conjugate)


@_rope_inplace.register_fake
def _rope_inplace_fake(q, k, positions, inv_freq, layout, sections, scaling, conjugate) -> None:
    return None


def _rotate_in_place(q, k, positions, inv_freq, layout, sections, scaling, conjugate) -> None:
    if torch.compiler.is_compiling():
        _rope_inplace(q, k, positions, inv_freq, layout, sections, scaling, conjugate)
    else:
        _rotate_into(q, k, q, k, positions, inv_freq, layout, sections, scaling, conjugate)


class _RopeInplace(torch.autograd.Function):
    """In-place forward (marks q, k dirty). The backward rotates the incoming gradients by -angle into new tensors:
    gradients may be shared with other branches of the graph or be the caller's grad_outputs, so they are never
    written; lanes [R, D) of the gradient pass through (the identity)."""

    @staticmethod
    def forward(ctx, q, k, positions, inv_freq, layout, sections, scaling):
        _rotate_in_place(q, k, positions, inv_freq, layout, sections, scaling, False)
        ctx.mark_dirty(q, k)
        ctx.save_for_backward(positions, inv_freq)
        ctx.static_args = (layout, sections, scaling)
        return q, k

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernel's backward is not itself differentiable: say so
    def backward(ctx, grad_q, grad_k):
        positions, inv_freq = ctx.saved_tensors
        grads = (_contiguous_last_dim(grad_q), _contiguous_last_dim(grad_k), positions, inv_freq)
        if torch.compiler.is_compiling():  # the traceable out-of-place op
            grad_q, grad_k = _rope(*grads, *ctx.static_args, True)
        else:
            grad_q, grad_k = _rotated(*grads, *ctx.static_args, True)
        return grad_q, grad_k, None, None, None, None, None


def _rotate(q, k, positions, inv_freq, layout, sections, scaling, inplace):
    if inplace and torch.compiler.is_compiling():  # functionalization handles in-place writes to views
        return _RopeInplace.apply(q, k, positions, inv_freq, layout, sections, scaling)
    if inplace:
        _check_in_place_target(q, k)
        if torch.is_grad_enabled() and (q._is_view() or k._is_view()) and (q.requires_grad or k.requires_grad):
            # autograd cannot mark two views dirty from one Function: rotate out of place, then write only the
            # rotary lanes back through the views, which autograd records like any slice assignment.
            q_out, k_out = _RopeFunction.apply(q, k, positions, inv_freq, layout, sections, scaling)
            rotary_dim = _rotary_dim(layout, inv_freq)
            q[..., :rotary_dim] = q_out[..., :rotary_dim]
            k[..., :rotary_dim] = k_out[..., :rotary_dim]
            return q, k
        return _RopeInplace.apply(q, k, positions, inv_freq, layout, sections, scaling)
    if torch.compiler.is_compiling():
        return _rope(q, k, positions, inv_freq, layout, sections, scaling, False)
    return _RopeFunction.apply(q, k, positions, inv_freq, layout, sections, scaling)


def _rotary_dim(layout: int, inv_freq: torch.Tensor) -> int:
    return 4 * inv_freq.numel() if layout == triton_rope.LAYOUT_VISION else 2 * inv_freq.numel()


def _check_in_place_target(q: torch.Tensor, k: torch.Tensor) -> None:
    """In-place rotation refuses what PyTorch's own in-place ops refuse, before anything is written."""
    for name, x in (("q", q), ("k", k)):
        if torch.is_grad_enabled() and x.is_leaf and x.requires_grad:
            raise RuntimeError(
                f"inplace=True on {name}, a leaf tensor that requires grad: rotate a non-leaf (e.g. the projection "
                "output) or use inplace=False"
            )
        if any(stride == 0 and size > 1 for size, stride in zip(x.shape, x.stride())):
            raise ValueError(
                f"inplace=True on {name}, whose elements overlap in memory (expanded or stride-0): rotating it in "
                "place would race; use inplace=False or .contiguous() first"
            )


def apply_mrope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    interleaved: bool = False,
    attention_scaling: float = 1.0,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Text multimodal rope (Qwen2/2.5-VL chunked, Qwen3-VL / Qwen3.5 interleaved, partial rotary).

    q: (T, Hq, D) packed or (B, S, Hq, D); k: same leading dims, Hk heads; fp16/bf16/fp32, one dtype, any strides
    with a contiguous last dim. positions: integer (3, T) or (3, B, S), [temporal, height, width].
    inv_freq: fp32 (R/2,), R <= D; lanes [R, D) pass through. mrope_section: 3 ints summing to R/2.
    attention_scaling multiplies cos and sin. Returns (q_out, k_out) in the input dtype; with inplace=True,
    q and k themselves (only lanes [0, R) written; not a leaf that requires grad, not overlapping memory).
    Differentiable in q and k, not in positions or inv_freq; incoming gradients are never modified.
    """
    sections = _check_sections(mrope_section, inv_freq)
    _check_pair(q, k, inv_freq, positions)
    lead = tuple(q.shape)[:-2]
    if tuple(positions.shape) != (3, *lead):
        raise ValueError(
            f"positions has shape {tuple(positions.shape)} but q/k have {lead} tokens: pass (3, *{lead}) "
            "(temporal, height, width rows; drop the text row 0 of 4-row position_ids)"
        )
    rotary_dim = 2 * inv_freq.numel()
    if rotary_dim > q.shape[-1]:
        raise ValueError(f"rotary dim R = 2*len(inv_freq) = {rotary_dim} exceeds head_dim {q.shape[-1]}")
    layout = triton_rope.LAYOUT_INTERLEAVED if interleaved else triton_rope.LAYOUT_CHUNKED
    if isinstance(attention_scaling, bool) or not isinstance(attention_scaling, int | float):
        raise ValueError(f"attention_scaling must be a number (1.0 for the default rope), got {attention_scaling!r}")
    return _rotate(q, k, positions, inv_freq, layout, sections, float(attention_scaling), inplace)


def apply_vision_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """ViT 2-D rope. q, k: (T, H, D) (any strides, contiguous last dim), one float dtype; positions: integer
    (T, 2) [row, col]; inv_freq: fp32 (D/4,). Lane j < D/4 uses row * inv_freq[j], D/4 <= j < D/2 uses
    col * inv_freq[j - D/4]; rotate-half pairs over the whole head. Returns (q_out, k_out) in the input dtype
    (q, k themselves with inplace=True). Differentiable in q and k."""
    _check_pair(q, k, inv_freq, positions)
    if q.dim() != 3:
        raise ValueError(f"vision q/k must be (T, H, D), got {q.dim()}-D; flatten patches into T")
    n_tokens, head_dim = q.shape[0], q.shape[-1]
    if head_dim % 4 or 4 * inv_freq.numel() != head_dim:
        raise ValueError(
            f"vision rope needs head_dim divisible by 4 and inv_freq of length head_dim/4; got head_dim {head_dim}, "
            f"len(inv_freq) {inv_freq.numel()} (transformers builds it from dim = head_dim/2)"
        )
    if tuple(positions.shape) != (n_tokens, 2):
        raise ValueError(f"vision positions must be (T, 2) = ({n_tokens}, 2) [row, col], got {tuple(positions.shape)}")
    return _rotate(q, k, positions, inv_freq, triton_rope.LAYOUT_VISION, _NO_SECTIONS, 1.0, inplace)


def _check_sections(mrope_section: Sequence[int], inv_freq: torch.Tensor) -> list[int]:
    try:
        sections = [operator.index(s) for s in mrope_section]
    except TypeError:
        sections = None
    if sections is None or len(sections) != 3 or any(s < 0 for s in sections):
        raise ValueError(f"mrope_section must be 3 non-negative ints [temporal, height, width], got {mrope_section}")
    if sum(sections) != inv_freq.numel():
        raise ValueError(
            f"mrope_section {sections} sums to {sum(sections)} but len(inv_freq) = R/2 = {inv_freq.numel()}: "
            "use the model config's rope_parameters['mrope_section'] with the inv_freq of the same rotary module"
        )
    return sections


def _check_pair(q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor) -> None:
    """Checks shared by both ops: shapes, dtypes, devices, strides."""
    for name, x in (("q", q), ("k", k), ("positions", positions), ("inv_freq", inv_freq)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    q_shape, k_shape = tuple(q.shape), tuple(k.shape)
    if len(q_shape) not in (3, 4) or len(k_shape) != len(q_shape):
        raise ValueError(f"q and k must both be (T, H, D) or (B, S, H, D), got {q_shape} and {k_shape}")
    if q_shape[:-2] != k_shape[:-2] or q_shape[-1] != k_shape[-1]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must share leading (token) dims and head_dim; only the "
            "head count may differ (GQA)"
        )
    if q_shape[-1] % 2:
        raise ValueError(f"head_dim must be even for rotate-half rope, got {q_shape[-1]}")
    if q.dtype != k.dtype or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q and k must share one dtype among {_FLOAT_DTYPES}, got {q.dtype} and {k.dtype}")
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1:
        raise ValueError(
            f"inv_freq must be a 1-D float32 tensor, got {inv_freq.dtype} {tuple(inv_freq.shape)}: pass the rotary "
            "module's inv_freq buffer (fp32), not a cast copy"
        )
    if positions.dtype not in _POSITION_DTYPES:
        raise ValueError(f"positions must be an integer tensor (torch.long or torch.int32), got {positions.dtype}")
    if not (q.device == k.device == positions.device == inv_freq.device):
        devices = [str(t.device) for t in (q, k, positions, inv_freq)]
        raise ValueError(f"q, k, positions and inv_freq must be on one device, got {devices} (in that order)")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(
            f"q and k need a contiguous last (head_dim) dim, got strides {q.stride()} and {k.stride()}: transposed "
            "views of other dims are fine, call .contiguous() only if the head dim itself is strided"
        )
    if not inv_freq.is_contiguous():
        raise ValueError("inv_freq must be contiguous; pass the rotary module's buffer")
