"""Public rotary ops: input validation and the one autograd path to the kernels.

`apply_mrope` / `apply_vision_rope_table` (and `apply_vision_rope`, which builds the table first) validate their
inputs (ValueError saying how to fix them), then rotate out of place through `_RopeFunction`, an autograd.Function
whose forward and backward each launch the kernel once (the backward is the forward with the angle negated,
CONJUGATE) and save only what the angles come from: text positions and inv_freq, or the vision cos/sin table.
The vision table (`vision_rope_table`, (T, D) fp32) is built once per vision tower forward by the patch and shared
by every block's forward and backward: per block, the kernel then only reads it.

Host cost per call is kept small: at small T host time is all of a call's time, and a layer stack at 16k tokens
can be host-bound (docs/performance.md). Validation depends only on tensor metadata (shapes, strides, dtypes,
devices) and the static args, so a call signature is validated once. Its `_Rope`, found by one dict hit on later
calls, carries the launch plans (`triton_rope.launch_plan`) of its forward and of its backward per gradient layout,
and each plan the compiled kernels it launches directly (`triton_rope.launch`). A repeated forward is that dict hit,
two allocations and the driver's launch (plus the kernel's dict hit); a backward adds one dict hit for the
gradients' layout. transformers' (B, H, S, D) views rotate as they are (`heads_first`): transposed views would add
host time to the forward and autograd nodes to the backward.

Under torch.compile the same Function is traced; it reaches the kernel through the opaque custom op
`mrope_kernels::rope` (fake impl: outputs like the inputs), so `fullgraph=True` traces without a graph break.
Validation then runs uncached, traced like any Python.

Dispatch: CUDA tensors run the Triton kernel; CPU tensors run it under TRITON_INTERPRET=1, otherwise the
plain-PyTorch reference (`mrope_kernels.reference`) with the same math.

`angles` below, per layout: text (positions, inv_freq); vision (table,).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from mrope_kernels import triton_rope
from mrope_kernels.reference import apply_mrope_reference, rotate_by_vision_table_reference

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_POSITION_DTYPES = (torch.int64, torch.int32)
_NO_SECTIONS = (0, 0, 0)
_NUMBER_TYPES = (int, float)


def runs_triton(device: torch.device) -> bool:
    """Whether rotations on `device` run the Triton kernels (else the plain-PyTorch reference, same math)."""
    return device.type == "cuda" or (device.type == "cpu" and triton_rope.RUNS_IN_INTERPRETER)


class _Rope:
    """One validated call signature: the static args, and the launch plans of its rotations, each built at its first
    launch: the forward's (fixed by the signature) and the backward's, one per layout of the incoming gradients.
    Under torch.compile a traced call carries only the static args; the opaque op's eager run finds its own."""

    __slots__ = ("backward_plans", "forward_plan", "heads_first", "in_place", "layout", "scaling", "sections")

    def __init__(
        self, layout: int, sections: tuple[int, int, int], scaling: float, heads_first: bool, in_place: bool = False
    ):
        self.layout, self.sections, self.scaling, self.heads_first = layout, sections, scaling, heads_first
        self.in_place = in_place  # the forward rotates q and k themselves (the backward never does)
        self.forward_plan = None
        self.backward_plans = {}

    def add_plan(self, q, k, q_out, k_out, angles, conjugate: bool) -> triton_rope.LaunchPlan:
        """Plan the rotation of q, k (inputs, or gradients when conjugate) into q_out, k_out, and keep it."""
        dtypes = (q.dtype, k.dtype, q_out.dtype, k_out.dtype, *[t.dtype for t in angles])
        if self.layout == triton_rope.LAYOUT_VISION:
            plan = triton_rope.vision_launch_plan(
                q.shape, q.stride(), k.shape, k.stride(), q_out.stride(), k_out.stride(), dtypes, conjugate
            )
        else:
            order = _heads_second if self.heads_first else tuple
            positions, inv_freq = angles
            plan = triton_rope.launch_plan(
                order(q.shape), order(q.stride()), order(k.shape), order(k.stride()), order(q_out.stride()),
                order(k_out.stride()), positions.stride(), dtypes, inv_freq.shape[0], self.layout, self.sections,
                self.scaling, conjugate, in_place=self.in_place and not conjugate,
            )  # fmt: skip
        if conjugate:
            self.backward_plans[q.stride(), k.stride()] = plan
        else:
            self.forward_plan = plan
        return plan


def _rotated(q, k, angles, rope: _Rope, conjugate: bool):
    """Rotate q, k into new tensors with q's / k's layout (empty_like keeps dense strides, transposed or not), or,
    for an in-place rope's forward, into q and k themselves."""
    in_place = rope.in_place and not conjugate
    if runs_triton(q.device):
        q_out, k_out = (q, k) if in_place else (torch.empty_like(q), torch.empty_like(k))
        # The forward's inputs are part of the signature (so are its outputs' strides, empty_like's function of
        # them); the backward's gradients come in whatever layout the graph after the rope hands back.
        plan = rope.backward_plans.get((q.stride(), k.stride())) if conjugate else rope.forward_plan
        if plan is None:
            plan = rope.add_plan(q, k, q_out, k_out, angles, conjugate)
        triton_rope.launch(plan, q, k, q_out, k_out, *angles)
        return q_out, k_out
    if rope.layout == triton_rope.LAYOUT_VISION:
        return rotate_by_vision_table_reference(q, k, angles[0], conjugate)
    # Negating integer positions negates the fp32 angle exactly (cos even, sin odd).
    positions, inv_freq = angles
    signed_positions = -positions if conjugate else positions
    interleaved = rope.layout == triton_rope.LAYOUT_INTERLEAVED
    q_out, k_out = apply_mrope_reference(
        q, k, signed_positions, inv_freq, rope.sections, interleaved, rope.scaling, heads_first=rope.heads_first
    )
    return (q.copy_(q_out), k.copy_(k_out)) if in_place else (q_out, k_out)


@torch.library.custom_op("mrope_kernels::rope", mutates_args=())
def _rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    angles: list[torch.Tensor],
    layout: int,
    sections: list[int],
    scaling: float,
    heads_first: bool,
    conjugate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_rotated` as one opaque node for torch.compile graphs (eager calls skip the dispatcher's host cost)."""
    angles = tuple(angles)
    rope = _rope(q, k, angles, layout, tuple(sections), scaling, heads_first)
    return _rotated(q, k, angles, rope, conjugate)


@_rope_op.register_fake
def _rope_op_fake(q, k, angles, layout, sections, scaling, heads_first, conjugate):
    return torch.empty_like(q), torch.empty_like(k)


def _rotate(q, k, angles, rope: _Rope, conjugate: bool):
    """`_rotated`, or under torch.compile the opaque op (whose eager run finds the call's `_Rope` itself)."""
    if torch.compiler.is_compiling():
        return _rope_op(q, k, list(angles), rope.layout, rope.sections, rope.scaling, rope.heads_first, conjugate)
    return _rotated(q, k, angles, rope, conjugate)


def _contiguous_last_dim(grad: torch.Tensor) -> torch.Tensor:
    # Autograd may hand over expanded (stride-0) or otherwise odd gradients; the kernel needs stride(-1) == 1.
    return grad if grad.stride(-1) == 1 else grad.contiguous()


def _rotate_back(ctx, grad_q, grad_k):
    """The backward: the incoming gradients rotated by -angle into new tensors (never in place: a gradient may be
    the caller's grad_outputs or shared with another branch)."""
    angles = tuple(t for t in ctx.saved_tensors if t is not None)
    grad_q, grad_k = _rotate(_contiguous_last_dim(grad_q), _contiguous_last_dim(grad_k), angles, ctx.rope, True)
    return grad_q, grad_k, None, None, None


# The kernel's backward is not itself differentiable: once_differentiable makes a second backward through it raise.
_rotate_back_once = torch.autograd.function.once_differentiable(_rotate_back)


class _RopeFunction(torch.autograd.Function):
    """Out-of-place rotation of q and k by the angles (text: positions, inv_freq; vision: table, None) as `rope`
    (a `_Rope`) says; the backward rotates the gradients back. Two angle arguments, not *angles: dynamo traces an
    autograd.Function of fixed arity (with varargs it loses `ctx`)."""

    @staticmethod
    def forward(ctx, q, k, angles_0, angles_1, rope):
        ctx.save_for_backward(angles_0, angles_1)
        ctx.rope = rope
        if rope.in_place:
            ctx.mark_dirty(q, k)
        angles = (angles_0,) if angles_1 is None else (angles_0, angles_1)
        return _rotate(q, k, angles, rope, False)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        # once_differentiable acts only with grad mode on (create_graph=True); off, it would only add its no_grad's
        # host time.
        return (_rotate_back_once if torch.is_grad_enabled() else _rotate_back)(ctx, grad_q, grad_k)


def apply_mrope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    interleaved: bool = False,
    attention_scaling: float = 1.0,
    *,
    heads_first: bool = False,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Text multimodal rope (Qwen2/2.5-VL chunked, Qwen3-VL / Qwen3.5 interleaved, partial rotary).

    q: (T, Hq, D) packed or (B, S, Hq, D), or with heads_first (B, Hq, S, D) (transformers' layout, rotated as it
    is: no transposes); k: same leading dims, Hk heads; fp16/bf16/fp32, one dtype, any strides with a contiguous
    last dim. positions: integer (3, T) or (3, B, S), [temporal, height, width].
    inv_freq: fp32 (R/2,), R <= D; lanes [R, D) pass through. mrope_section: 3 ints summing to R/2.
    attention_scaling multiplies cos and sin. Returns new tensors (q_out, k_out) in the input dtype and layout.
    Differentiable in q and k, not in positions or inv_freq; incoming gradients are never modified.
    inplace: rotate q and k themselves and return them, reading and writing only the R rotary lanes (with partial
    rotary, R/D of an out-of-place call's bytes). Autograd is told (mark_dirty): a leaf that requires grad, or a
    tensor another op saved for its backward, makes autograd raise rather than compute a wrong gradient. The backward
    stays out of place. Not under torch.compile (ValueError): a traced graph takes the out-of-place op.
    """
    sections = _as_sections(mrope_section)
    if isinstance(attention_scaling, bool) or not isinstance(attention_scaling, _NUMBER_TYPES):
        raise ValueError(f"attention_scaling must be a number (1.0 for the default rope), got {attention_scaling!r}")
    if inplace and torch.compiler.is_compiling():
        raise ValueError("apply_mrope(inplace=True) runs eagerly only: under torch.compile pass inplace=False")
    layout = triton_rope.LAYOUT_INTERLEAVED if interleaved else triton_rope.LAYOUT_CHUNKED
    rope = _rope(q, k, (positions, inv_freq), layout, sections, float(attention_scaling), heads_first, inplace)
    return _RopeFunction.apply(q, k, positions, inv_freq, rope)


def vision_rope_table(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The ViT 2-D rope's angles as a (T, D) fp32 table: cos of frequency lane f in column f, its sin in column
    D/2 + f, f < D/2; lane f < D/4 is row * inv_freq[f], D/4 <= f < D/2 is col * inv_freq[f - D/4]. positions:
    integer (T, 2) [row, col]; inv_freq: fp32 (D/4,). transformers' own fp32 ops (product, cos, sin), so the table
    equals the first halves of its cos/sin tables bit for bit."""
    _check_vision_angles(positions, inv_freq)
    angles = (positions.float()[:, :, None] * inv_freq).flatten(1)  # (T, D/2)
    return torch.cat((angles.cos(), angles.sin()), dim=1)


def apply_vision_rope_table(q: torch.Tensor, k: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ViT 2-D rope by a `vision_rope_table`: q, k (T, H, D) (any strides, contiguous last dim), one float dtype;
    table (T, D) fp32, contiguous. Rotate-half pairs over the whole head. Returns new tensors (q_out, k_out) in the
    input dtype and layout. Differentiable in q and k. Build the table once and pass it to every layer."""
    rope = _rope(q, k, (table,), triton_rope.LAYOUT_VISION, _NO_SECTIONS, 1.0, False)
    return _RopeFunction.apply(q, k, table, None, rope)


def apply_vision_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ViT 2-D rope, one call: `apply_vision_rope_table(q, k, vision_rope_table(positions, inv_freq))`. q, k:
    (T, H, D); positions: integer (T, 2) [row, col]; inv_freq: fp32 (D/4,)."""
    return apply_vision_rope_table(q, k, vision_rope_table(positions, inv_freq))


# --------------------------------------------------------------------------------------------------------------
# validation: pure functions of tensor metadata, so a signature seen before is not checked again
# --------------------------------------------------------------------------------------------------------------

# Signature -> its `_Rope`, oldest first; packs of new lengths keep adding signatures, so the oldest make way.
_ROPES: dict[tuple, _Rope] = {}
_MAX_ROPES = 1024


def _rope(q, k, angles, layout, sections, scaling, heads_first, in_place=False) -> _Rope:
    """The `_Rope` of a call: a dict hit for a signature seen before, else validated (ValueError) and kept. Under
    torch.compile validated every time (traced like any Python: no dict of symbolic shapes) and not kept."""
    if torch.compiler.is_compiling():
        _validate(q, k, angles, layout, sections, heads_first)
        return _Rope(layout, sections, scaling, heads_first)
    try:
        key = (
            q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
            *[(t.shape, t.stride(), t.dtype, t.device) for t in angles],
            layout, sections, scaling, heads_first, in_place,
        )  # fmt: skip
    except AttributeError:  # not a tensor: validation names it
        _validate(q, k, angles, layout, sections, heads_first)
        raise
    rope = _ROPES.get(key)
    if rope is None:
        _validate(q, k, angles, layout, sections, heads_first)
        if len(_ROPES) >= _MAX_ROPES:
            del _ROPES[next(iter(_ROPES))]
        rope = _ROPES[key] = _Rope(layout, sections, scaling, heads_first, in_place)
    return rope


def _validate(q, k, angles, layout, sections, heads_first) -> None:
    names = ("table",) if layout == triton_rope.LAYOUT_VISION else ("positions", "inv_freq")
    for name, x in (("q", q), ("k", k), *zip(names, angles, strict=True)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if heads_first and not q.dim() == k.dim() == 4:
        raise ValueError(f"heads_first q and k must be (B, H, S, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    # Everything the checks read, per tensor: (shape, strides, dtype, device); q's and k's in (B, S, H, D) order
    # when they come heads first.
    order = _heads_second if heads_first else tuple
    q_meta, k_meta = [(order(x.shape), order(x.stride()), x.dtype, x.device) for x in (q, k)]
    angle_meta = [(x.shape, x.stride(), x.dtype, x.device) for x in angles]
    _check_pair(q_meta, k_meta)
    if layout == triton_rope.LAYOUT_VISION:
        _check_vision(q_meta, *angle_meta)
    else:
        _check_text(q_meta, *angle_meta, sections)


def _heads_second(dims: Sequence[int]) -> tuple[int, ...]:
    """(B, H, S, D) shape or strides in the kernel's (B, S, H, D) order: what a transpose(1, 2) view would have."""
    return (dims[0], dims[2], dims[1], dims[3])


def _as_sections(mrope_section: Sequence[int]) -> tuple[int, int, int]:
    try:
        sections = tuple(map(operator.index, mrope_section))
    except TypeError:
        sections = None
    if sections is None or len(sections) != 3 or min(sections) < 0:
        raise ValueError(f"mrope_section must be 3 non-negative ints [temporal, height, width], got {mrope_section}")
    return sections


def _check_text(q, positions, inv_freq, sections: tuple[int, int, int]) -> None:
    """q, positions, inv_freq: (shape, strides, dtype, device) each."""
    _check_inv_freq(inv_freq)
    positions_dtype, positions_device, inv_device = positions[2], positions[3], inv_freq[3]
    if positions_dtype not in _POSITION_DTYPES:
        raise ValueError(f"positions must be an integer tensor (torch.long or torch.int32), got {positions_dtype}")
    if not (q[3] == positions_device == inv_device):
        devices = [str(d) for d in (q[3], positions_device, inv_device)]
        raise ValueError(f"q/k, positions and inv_freq must be on one device, got {devices} (in that order)")
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


def _check_vision(q, table) -> None:
    """q, table: (shape, strides, dtype, device) each."""
    q_shape, table_shape, table_strides, table_dtype, table_device = q[0], *table
    if len(q_shape) != 3:
        raise ValueError(f"vision q/k must be (T, H, D), got {len(q_shape)}-D; flatten patches into T")
    n_tokens, head_dim = q_shape[0], q_shape[-1]
    if table_dtype != torch.float32 or len(table_shape) != 2:
        raise ValueError(
            f"the vision table must be a 2-D float32 tensor from vision_rope_table, got {table_dtype} "
            f"{tuple(table_shape)}"
        )
    if head_dim % 4 or table_shape[1] != head_dim:
        raise ValueError(
            f"vision rope needs head_dim divisible by 4 and inv_freq of length head_dim/4; got head_dim {head_dim}, "
            f"a table of {table_shape[1]} columns = 4 x len(inv_freq) (transformers builds inv_freq from dim = "
            "head_dim/2)"
        )
    if table_shape[0] != n_tokens:
        raise ValueError(
            f"vision positions (and their table) must be (T, 2) = ({n_tokens}, 2) [row, col], one row per token of "
            f"q/k; got {table_shape[0]} rows"
        )
    if tuple(table_strides) != (head_dim, 1):
        raise ValueError(f"the vision table must be contiguous, got strides {tuple(table_strides)}")
    if table_device != q[3]:
        raise ValueError(f"q/k and the vision table must be on one device, got {q[3]} and {table_device}")


def _check_vision_angles(positions, inv_freq) -> None:
    """What `vision_rope_table` needs: integer (T, 2) positions and a 1-D fp32 inv_freq on one device."""
    for name, x in (("positions", positions), ("inv_freq", inv_freq)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if positions.dtype not in _POSITION_DTYPES:
        raise ValueError(f"positions must be an integer tensor (torch.long or torch.int32), got {positions.dtype}")
    if positions.dim() != 2 or positions.shape[1] != 2:
        raise ValueError(f"vision positions must be (T, 2) [row, col], got {tuple(positions.shape)}")
    _check_inv_freq((inv_freq.shape, inv_freq.stride(), inv_freq.dtype, inv_freq.device))
    if positions.device != inv_freq.device:
        raise ValueError(f"positions and inv_freq must be on one device, got {positions.device} and {inv_freq.device}")


def _check_inv_freq(inv_freq) -> None:
    inv_shape, inv_strides, inv_dtype, _ = inv_freq
    if inv_dtype != torch.float32 or len(inv_shape) != 1:
        raise ValueError(
            f"inv_freq must be a 1-D float32 tensor, got {inv_dtype} {tuple(inv_shape)}: pass the rotary "
            "module's inv_freq buffer (fp32), not a cast copy"
        )
    if inv_shape[0] > 1 and inv_strides[0] != 1:
        raise ValueError("inv_freq must be contiguous; pass the rotary module's buffer")


def _check_pair(q, k) -> None:
    """Checks of q and k, (shape, strides, dtype, device) each, shared by both ops."""
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
    if q_device != k_device:
        raise ValueError(f"q and k must be on one device, got {q_device} and {k_device}")
    if q_strides[-1] != 1 or k_strides[-1] != 1:
        raise ValueError(
            f"q and k need a contiguous last (head_dim) dim, got strides {q_strides} and {k_strides}: transposed "
            "views of other dims are fine, call .contiguous() only if the head dim itself is strided"
        )
