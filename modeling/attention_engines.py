"""Varlen attention engines for packed batches on a GPU, chosen by `kernels.attention`.

- "fa2": FlashAttention-2 — flash-attn's `flash_attn_varlen_func` when that package is installed, else torch's
  `varlen_attn` (the same FA2 kernels inside aten). Runs on every CUDA GPU torch supports.
- "fa4": FlashAttention-4 (package `flash-attn-4`, module `flash_attn.cute`), CuTe-DSL kernels for Hopper (sm90)
  and Blackwell (sm100). Called through custom ops of ours (`qwen_vl::fa4_varlen_fwd` / `_bwd`): its own
  autograd.Function would break a torch.compile graph at every attention call, a custom op is one opaque node
  with a fake (shape-only) implementation for tracing. The backward op takes the forward's output and log-sum-exp.

`resolve_engine` picks the engine for "auto" (fa4 where it imports and the GPU is one it targets, else fa2) and says
why; `varlen_attention` runs one call. Both engines take q (T,H,D), k/v (T,Hkv,D) in bf16/fp16 with GQA by head
count, and align causal masking bottom-right where a key segment is longer than its query segment.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Literal

import torch

from core.config_tree import ConfigError

Engine = Literal["fa2", "fa4"]
ENGINES: tuple[str, ...] = ("fa2", "fa4")
FA4_ARCHES = (9, 10)
"""Compute-capability majors flash-attn-4 builds kernels for (Hopper, Blackwell); elsewhere "auto" takes fa2."""
FA4_HEAD_DIMS = (64, 128, 256)
"""Head dims on which fa4's forward and backward matched the fp32 reference as closely as fa2 (one H100,
docs/performance.md#attention-engines). At 72 and 80 (the Qwen2.5-VL and Qwen3-VL-8B ViTs) its sm90 backward gave
dq off by more than 100% relative: those calls stay on fa2."""

# flash-attn 2 installs `flash_attn/flash_attn_interface.py`; flash-attn-4 installs only the `flash_attn.cute`
# namespace package, so finding "flash_attn" alone does not tell which is there.
HAS_FLASH_ATTN_2 = importlib.util.find_spec("flash_attn") is not None and (
    importlib.util.find_spec("flash_attn.flash_attn_interface") is not None
)


def _find_fa4() -> bool:
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # no flash_attn at all
        return False


HAS_FLASH_ATTN_4 = _find_fa4()


def _varlen_attn_takes_gqa() -> bool:
    """torch 2.13's varlen_attn shares kv heads itself (`enable_gqa`); 2.11's needs them repeated."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # a torch without varlen_attn: the fa2 engine needs flash-attn
        return False
    return "enable_gqa" in inspect.signature(varlen_attn).parameters


_VARLEN_ATTN_TAKES_GQA = _varlen_attn_takes_gqa()  # read once here, not in every torch.compile trace


def fa2_kernel_name() -> str:
    """What the fa2 engine calls here, for logs and benchmark records."""
    if HAS_FLASH_ATTN_2:
        return "flash_attn.flash_attn_varlen_func"
    return "torch varlen_attn" + ("" if _VARLEN_ATTN_TAKES_GQA else " (kv heads repeated: no enable_gqa)")


def resolve_engine(requested: str, device: torch.device | None = None) -> tuple[Engine, str]:
    """The engine a run uses and the reason, for `kernels.attention` = "auto" | "fa2" | "fa4".

    "fa4" on a host where it cannot run raises ConfigError (train.py's one-line error) naming what is missing;
    "auto" falls back to fa2 and the reason says why. On a CPU the engines are not called (packed attention takes
    per-sample SDPA there), so "auto" resolves to fa2 without looking further.
    """
    if requested not in ("auto", *ENGINES):
        raise ConfigError(f"kernels.attention must be auto, fa2 or fa4, got {requested!r}.")
    if requested == "fa2":
        return "fa2", f"requested ({fa2_kernel_name()})"
    on_cuda = device is not None and device.type == "cuda" and torch.cuda.is_available()
    missing = None
    if not HAS_FLASH_ATTN_4:
        missing = "flash-attn-4 is not installed (pip install -r requirements-fa4.txt)"
    elif not on_cuda:
        missing = "no CUDA device"
    elif torch.cuda.get_device_capability(device)[0] not in FA4_ARCHES:
        major, minor = torch.cuda.get_device_capability(device)
        missing = f"flash-attn-4 has no kernels for compute capability {major}.{minor} (Hopper and Blackwell only)"
    if missing is None:
        return "fa4", "FlashAttention-4 (flash_attn.cute) on this GPU"
    if requested == "fa4":
        raise ConfigError(f"kernels.attention=fa4 cannot run here: {missing}. Use kernels.attention=auto or fa2.")
    return "fa2", f"{fa2_kernel_name()}; fa4 not used: {missing}"


def engine_for_head_dim(engine: Engine, head_dim: int) -> Engine:
    """The engine a call of `head_dim` runs on: fa4 only for FA4_HEAD_DIMS, fa2 otherwise."""
    return "fa4" if engine == "fa4" and head_dim in FA4_HEAD_DIMS else "fa2"


def describe(engine: Engine, head_dims: dict[str, int]) -> str:
    """Which engine each attention of a model runs on, e.g. "text (head dim 128): fa4; vision (head dim 80): fa2"."""
    return "; ".join(f"{part} (head dim {dim}): {engine_for_head_dim(engine, dim)}" for part, dim in head_dims.items())


def _fa2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal):
    if HAS_FLASH_ATTN_2:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale, causal=causal
        )
    from torch.nn.attention.varlen import varlen_attn

    window = (-1, 0) if causal else (-1, -1)
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not _VARLEN_ATTN_TAKES_GQA:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        groups = 1
    extra = {"enable_gqa": True} if groups > 1 else {}
    return varlen_attn(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale, window_size=window, **extra
    )


@torch.library.custom_op("qwen_vl::fa4_varlen_fwd", mutates_args=(), device_types="cuda")
def fa4_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4 varlen forward. q (Tq,H,D), k/v (Tk,Hkv,D) → out (Tq,H,D), lse fp32 (H,Tq)."""
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=scale,
        causal=causal,
        return_lse=True,
    )
    return out, lse


@fa4_varlen_fwd.register_fake
def _fa4_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("qwen_vl::fa4_varlen_bwd", mutates_args=(), device_types="cuda")
def fa4_varlen_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA4 varlen backward: (dq, dk, dv) shaped as (q, k, v)."""
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(
        q,
        k,
        v,
        out,
        grad_out,
        lse,
        scale,
        causal,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )[:3]
    return dq, dk, dv


@fa4_varlen_bwd.register_fake
def _fa4_varlen_bwd_fake(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *_):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fa4_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.scale, ctx.causal = max_seqlen_q, max_seqlen_k, scale, causal


def _fa4_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = fa4_varlen_bwd(
        grad_out.contiguous(),
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        ctx.max_seqlen_q,
        ctx.max_seqlen_k,
        ctx.scale,
        ctx.causal,
    )
    return dq, dk, dv, None, None, None, None, None, None


fa4_varlen_fwd.register_autograd(_fa4_backward, setup_context=_fa4_setup_context)


def varlen_attention(
    engine: Engine,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """One varlen attention call. q (Tq,H,D), k/v (Tk,Hkv,D) bf16/fp16, cu_seqlens int32 on q's device → (Tq,H,D)."""
    if engine == "fa4":
        q, k, v = (t.contiguous() for t in (q, k, v))
        return fa4_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal)[0]
    return _fa2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal)
