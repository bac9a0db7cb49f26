"""Public rotary ops: input validation and the one autograd path to the kernels.

`apply_mrope` / `apply_vision_rope` validate their inputs (ValueError saying how to fix them), then rotate out of
place through `_RopeFunction`, an autograd.Function whose forward and backward each launch the kernel once (the
backward is the forward with the angle negated, CONJUGATE) and save only positions and inv_freq.

Host cost per call is kept to what a training step needs: validation depends only on tensor metadata (shapes,
strides, dtypes, devices, sections), so its verdict is cached per signature; the launcher caches its grid and
constexprs the same way (`triton_rope.launch_plan`) and, per specialization, the compiled kernel it then launches
directly. A repeated call is three dict hits, two allocations and the driver's launch.

Under torch.compile the same Function is traced; it reaches the kernel through the opaque custom op
`mrope_kernels::rope` (fake impl: outputs like the inputs), so `fullgraph=True` traces without a graph break.
Validation then runs uncached, traced like any Python.

Dispatch: CUDA tensors run the Triton kernel; CPU tensors run it under TRITON_INTERPRET=1, otherwise the
plain-PyTorch reference (`mrope_kernels.reference`) with the same math.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch

from mrope_kernels import triton_rope
from mrope_kernels.reference import apply_mrope_reference, apply_vision_rope_reference

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_POSITION_DTYPES = (torch.int64, torch.int32)
_NO_SECTIONS = (0, 0, 0)


def runs_triton(device: torch.device) -> bool:
    """Whether rotations on `device` run the Triton kernels (else the plain-PyTorch reference, same math)."""
    return device.type == "cuda" or (device.type == "cpu" and triton_rope.RUNS_IN_INTERPRETER)


def _rotated(q, k, positions, inv_freq, layout, sections, scaling, conjugate):
    """Rotate q, k into new tensors with q's / k's layout (empty_like keeps dense transposed strides)."""
    if runs_triton(q.device):
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        triton_rope.rope_launch(q, k, q_out, k_out, positions, inv_freq, layout, sections, scaling, conjugate)
        return q_out, k_out
    # Reference path. Negating integer positions negates the fp32 angle exactly (cos even, sin odd).
    signed_positions = -positions if conjugate else positions
    if layout == triton_rope.LAYOUT_VISION:
        return apply_vision_rope_reference(q, k, signed_positions, inv_freq)
    interleaved = layout == triton_rope.LAYOUT_INTERLEAVED
    return apply_mrope_reference(q, k, signed_positions, inv_freq, sections, interleaved, scaling)


@torch.library.custom_op("mrope_kernels::rope", mutates_args=())
def _rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    layout: int,
    sections: list[int],
    scaling: float,
    conjugate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_rotated` as one opaque node for torch.compile graphs (eager calls skip the dispatcher's host cost)."""
    return _rotated(q, k, positions, inv_freq, layout, tuple(sections), scaling, conjugate)


@_rope_op.register_fake
def _rope_op_fake(q, k, positions, inv_freq, layout, sections, scaling, conjugate):
    return torch.empty_like(q), torch.empty_like(k)


def _contiguous_last_dim(grad: torch.Tensor) -> torch.Tensor:
    # Autograd may hand over expanded (stride-0) or otherwise odd gradients; the kernel needs stride(-1) == 1.
    return grad if grad.stride(-1) == 1 else grad.contiguous()


class _RopeFunction(torch.autograd.Function):
    """Out-of-place rotation of q and k; the backward rotates the incoming gradients by -angle into new tensors
    (never in place: a gradient may be the caller's grad_outputs or shared with another branch)."""

    @staticmethod
    def forward(ctx, q, k, positions, inv_freq, layout, sections, scaling):
        ctx.save_for_backward(positions, inv_freq)
        ctx.static_args = (layout, sections, scaling)
        rotate = _rope_op if torch.compiler.is_compiling() else _rotated
        return rotate(q, k, positions, inv_freq, layout, sections, scaling, False)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernel's backward is not itself differentiable: say so
    def backward(ctx, grad_q, grad_k):
        positions, inv_freq = ctx.saved_tensors
        rotate = _rope_op if torch.compiler.is_compiling() else _rotated
        grad_q, grad_k = rotate(
            _contiguous_last_dim(grad_q), _contiguous_last_dim(grad_k), positions, inv_freq, *ctx.static_args, True
        )
        return grad_q, grad_k, None, None, None, None, None


def apply_mrope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    interleaved: bool = False,
    attention_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Text multimodal rope (Qwen2/2.5-VL chunked, Qwen3-VL / Qwen3.5 interleaved, partial rotary).

    q: (T, Hq, D) packed or (B, S, Hq, D); k: same leading dims, Hk heads; fp16/bf16/fp32, one dtype, any strides
    with a contiguous last dim. positions: integer (3, T) or (3, B, S), [temporal, height, width].
    inv_freq: fp32 (R/2,), R <= D; lanes [R, D) pass through. mrope_section: 3 ints summing to R/2.
    attention_scaling multiplies cos and sin. Returns new tensors (q_out, k_out) in the input dtype and layout.
    Differentiable in q and k, not in positions or inv_freq; incoming gradients are never modified.
    """
    sections = _as_sections(mrope_section)
    if isinstance(attention_scaling, bool) or not isinstance(attention_scaling, int | float):
        raise ValueError(f"attention_scaling must be a number (1.0 for the default rope), got {attention_scaling!r}")
    check = _check_text if torch.compiler.is_compiling() else _check_text_cached
    check(*_signature(q, k, positions, inv_freq), sections)
    layout = triton_rope.LAYOUT_INTERLEAVED if interleaved else triton_rope.LAYOUT_CHUNKED
    return _RopeFunction.apply(q, k, positions, inv_freq, layout, sections, float(attention_scaling))


def apply_vision_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ViT 2-D rope. q, k: (T, H, D) (any strides, contiguous last dim), one float dtype; positions: integer
    (T, 2) [row, col]; inv_freq: fp32 (D/4,). Lane j < D/4 uses row * inv_freq[j], D/4 <= j < D/2 uses
    col * inv_freq[j - D/4]; rotate-half pairs over the whole head. Returns new tensors (q_out, k_out) in the
    input dtype and layout. Differentiable in q and k."""
    check = _check_vision if torch.compiler.is_compiling() else _check_vision_cached
    check(*_signature(q, k, positions, inv_freq))
    return _RopeFunction.apply(q, k, positions, inv_freq, triton_rope.LAYOUT_VISION, _NO_SECTIONS, 1.0)


# --------------------------------------------------------------------------------------------------------------
# validation: pure functions of tensor metadata, so a signature seen before is not checked again
# --------------------------------------------------------------------------------------------------------------


def _signature(q, k, positions, inv_freq) -> tuple:
    """Everything the checks read, per tensor: (shape, strides, dtype, device)."""
    for name, x in (("q", q), ("k", k), ("positions", positions), ("inv_freq", inv_freq)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return tuple((x.shape, x.stride(), x.dtype, x.device) for x in (q, k, positions, inv_freq))


def _as_sections(mrope_section: Sequence[int]) -> tuple[int, int, int]:
    try:
        sections = tuple(operator.index(s) for s in mrope_section)
    except TypeError:
        sections = None
    if sections is None or len(sections) != 3 or any(s < 0 for s in sections):
        raise ValueError(f"mrope_section must be 3 non-negative ints [temporal, height, width], got {mrope_section}")
    return sections


def _check_text(q, k, positions, inv_freq, sections: tuple[int, int, int]) -> None:
    """q, k, positions, inv_freq: (shape, strides, dtype, device) each."""
    _check_pair(q, k, positions, inv_freq)
    half = inv_freq[0][0]
    if sum(sections) != half:
        raise ValueError(
            f"mrope_section {list(sections)} sums to {sum(sections)} but len(inv_freq) = R/2 = {half}: "
            "use the model config's rope_parameters['mrope_section'] with the inv_freq of the same rotary module"
        )
    lead = tuple(q[0])[:-2]
    if tuple(positions[0]) != (3, *lead):
        raise ValueError(
            f"positions has shape {tuple(positions[0])} but q/k have {lead} tokens: pass (3, *{lead}) "
            "(temporal, height, width rows; drop the text row 0 of 4-row position_ids)"
        )
    if 2 * half > q[0][-1]:
        raise ValueError(f"rotary dim R = 2*len(inv_freq) = {2 * half} exceeds head_dim {q[0][-1]}")


def _check_vision(q, k, positions, inv_freq) -> None:
    """q, k, positions, inv_freq: (shape, strides, dtype, device) each."""
    _check_pair(q, k, positions, inv_freq)
    if len(q[0]) != 3:
        raise ValueError(f"vision q/k must be (T, H, D), got {len(q[0])}-D; flatten patches into T")
    n_tokens, head_dim = q[0][0], q[0][-1]
    if head_dim % 4 or 4 * inv_freq[0][0] != head_dim:
        raise ValueError(
            f"vision rope needs head_dim divisible by 4 and inv_freq of length head_dim/4; got head_dim {head_dim}, "
            f"len(inv_freq) {inv_freq[0][0]} (transformers builds it from dim = head_dim/2)"
        )
    if tuple(positions[0]) != (n_tokens, 2):
        raise ValueError(f"vision positions must be (T, 2) = ({n_tokens}, 2) [row, col], got {tuple(positions[0])}")


def _check_pair(q, k, positions, inv_freq) -> None:
    """Checks shared by both ops: shapes, dtypes, devices, strides."""
    (q_shape, q_strides, q_dtype, q_device), (k_shape, k_strides, k_dtype, k_device) = q, k
    q_shape, k_shape = tuple(q_shape), tuple(k_shape)
    if len(q_shape) not in (3, 4) or len(k_shape) != len(q_shape):
        raise ValueError(f"q and k must both be (T, H, D) or (B, S, H, D), got {q_shape} and {k_shape}")
    if q_shape[:-2] != k_shape[:-2] or q_shape[-1] != k_shape[-1]:
        raise ValueError(
            f"q {q_shape} and k {k_shape} must share leading (token) dims and head_dim; only the head count may "
            "differ (GQA)"
        )
    if q_shape[-1] % 2:
        raise ValueError(f"head_dim must be even for rotate-half rope, got {q_shape[-1]}")
    if q_dtype != k_dtype or q_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q and k must share one dtype among {_FLOAT_DTYPES}, got {q_dtype} and {k_dtype}")
    inv_shape, inv_strides, inv_dtype, inv_device = inv_freq
    if inv_dtype != torch.float32 or len(inv_shape) != 1:
        raise ValueError(
            f"inv_freq must be a 1-D float32 tensor, got {inv_dtype} {tuple(inv_shape)}: pass the rotary "
            "module's inv_freq buffer (fp32), not a cast copy"
        )
    _, _, positions_dtype, positions_device = positions
    if positions_dtype not in _POSITION_DTYPES:
        raise ValueError(f"positions must be an integer tensor (torch.long or torch.int32), got {positions_dtype}")
    if not (q_device == k_device == positions_device == inv_device):
        devices = [str(d) for d in (q_device, k_device, positions_device, inv_device)]
        raise ValueError(f"q, k, positions and inv_freq must be on one device, got {devices} (in that order)")
    if q_strides[-1] != 1 or k_strides[-1] != 1:
        raise ValueError(
            f"q and k need a contiguous last (head_dim) dim, got strides {q_strides} and {k_strides}: transposed "
            "views of other dims are fine, call .contiguous() only if the head dim itself is strided"
        )
    if inv_shape[0] > 1 and inv_strides[0] != 1:
        raise ValueError("inv_freq must be contiguous; pass the rotary module's buffer")


# A verdict is cached only when the check passes (lru_cache does not cache raised errors).
_check_text_cached = functools.lru_cache(maxsize=1024)(_check_text)
_check_vision_cached = functools.lru_cache(maxsize=1024)(_check_vision)
