"""Numeric self-check of a varlen gated delta rule against transformers' torch delta rule, cached on disk.

Why: fla 0.6.0 refuses its gated backward on Hopper with Triton >= 3.4 and < 3.7.1 (fla issue 640: a Triton codegen bug
that gives relative errors near 0.5). Whether the bug hits depends on the GPU, the Triton and fla versions and the head
dims, so `modeling.gated_delta` lets fla train there only after this check passes on the machine itself, for the model's
own Gated DeltaNet dims and the training dtype. The result is stored per (GPU, versions, dims, dtype), so the check (and
fla's compile and autotuning it triggers) is paid once per machine and software stack.

The check packs samples of uneven lengths (1, 63, 64, 65 and longer: every chunk-boundary case of the 64-token chunks)
and compares the candidate's output and its gradients with respect to q, k, v, g and β with transformers' torch delta
rule run per sample in fp32. The tolerance of each quantity is derived from the torch path's own rounding in the
same dtype (the torch rule fed the dtype's inputs), so a kernel passes when it is as exact as the path it replaces,
up to a small factor, and fails by orders of magnitude on the reported bug.

Run `python -m modeling.gated_delta_check` on a GPU to print the check for Qwen3.5's dims without training.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import itertools
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

QUANTITIES = ("o", "dq", "dk", "dv", "dg", "dbeta")
CHECK_LENGTHS = (1, 63, 64, 65, 200, 7)
"""Samples of the check's pack: a 1-token sample, both sides of a 64-token chunk boundary, a multi-chunk sample,
and a short one after it."""
ROUNDING_FACTOR = 4.0
"""A candidate may be this many times less exact than the torch path in the same dtype: a correct kernel rounds in
another order, within a small factor of the torch path's error; the Hopper miscompile is off by orders of magnitude."""
ERROR_FLOOR = 5e-3
"""Smallest tolerance: fp32 inputs make the torch path's own error ~1e-7, while fla's fp32 matmuls run in TF32
(about 1e-3 relative)."""

DeltaRule = Callable[..., torch.Tensor]
"""(q (1,T,Hk,K), k (1,T,Hk,K), v (1,T,Hv,V), g (1,T,Hv) fp32, beta (1,T,Hv), cu_seqlens int (n+1,)) → o (1,T,Hv,V),
with q and k L2-normalised inside and every sample of the pack starting from a zero state."""


@dataclass(frozen=True)
class GatedDeltaDims:
    """A Gated DeltaNet layer's head layout (grouped value heads: num_v_heads is a multiple of num_k_heads)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int

    @classmethod
    def of(cls, layer: torch.nn.Module) -> GatedDeltaDims:
        return cls(layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)


@dataclass
class CheckResult:
    """Relative errors ‖x − ref‖/‖ref‖ of the candidate and of the torch path in the same dtype, per quantity."""

    errors: dict[str, float]
    torch_errors: dict[str, float]
    tolerances: dict[str, float]

    @property
    def passed(self) -> bool:
        return all(self.errors[q] <= self.tolerances[q] for q in QUANTITIES)

    def worst(self) -> str:
        """The quantity with the largest error/tolerance ratio, as 'dg 0.48 > 0.016'."""
        name = max(QUANTITIES, key=lambda q: self.errors[q] / self.tolerances[q])
        relation = "<=" if self.errors[name] <= self.tolerances[name] else ">"
        return f"{name} {self.errors[name]:.2g} {relation} {self.tolerances[name]:.2g}"


def torch_delta_rule_per_sample(q, k, v, g, beta, cu_seqlens) -> torch.Tensor:
    """transformers' own torch chunked delta rule (not the fla dispatch wrapped around it), one sample at a time.

    Same signature as `DeltaRule`; the reference of the check and the shape of the torch path's numerics.
    """
    from transformers.models.qwen3_5 import modeling_qwen3_5

    rule = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    bounds = cu_seqlens.tolist()
    outputs = [
        rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], use_qk_l2norm_in_kernel=True)[0]
        for s, e in itertools.pairwise(bounds)
    ]
    return torch.cat(outputs, dim=1)


def delta_rule_inputs(dims: GatedDeltaDims, lengths, dtype, device, generator) -> tuple[torch.Tensor, ...]:
    """Random inputs shaped as a Gated DeltaNet layer feeds its delta rule: q, k, v and β in `dtype`, g (log decay,
    ≤ 0) in fp32 as the layer computes it, and an upstream gradient for o."""
    tokens = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cpu").to(device)

    q = randn(1, tokens, dims.num_k_heads, dims.head_k_dim).to(dtype)
    k = randn(1, tokens, dims.num_k_heads, dims.head_k_dim).to(dtype)
    v = randn(1, tokens, dims.num_v_heads, dims.head_v_dim).to(dtype)
    g = -F.softplus(randn(1, tokens, dims.num_v_heads) - 2.0)
    beta = randn(1, tokens, dims.num_v_heads).sigmoid().to(dtype)
    grad_o = randn(1, tokens, dims.num_v_heads, dims.head_v_dim).to(dtype)
    return q, k, v, g, beta, grad_o


def _run(rule: DeltaRule, inputs, grad_o, cu_seqlens, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """o and the gradients of (q, k, v, g, β) under `rule`, with inputs cast to `dtype` (None: as given; g stays
    fp32 whenever the inputs are low precision, as in the layer)."""
    leaves = [x.detach().to(dtype or x.dtype) for x in inputs]
    if dtype is not None and dtype != torch.float32:
        leaves[3] = inputs[3].detach().float()
    for leaf in leaves:
        leaf.requires_grad_(True)
    out = rule(*leaves, cu_seqlens)
    out.backward(grad_o.to(out.dtype))
    values = [out, *(leaf.grad for leaf in leaves)]
    return {name: value.detach().float() for name, value in zip(QUANTITIES, values, strict=True)}


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_delta_rule(
    candidate: DeltaRule,
    dims: GatedDeltaDims,
    dtype: torch.dtype,
    device: torch.device | str,
    lengths: tuple[int, ...] = CHECK_LENGTHS,
    seed: int = 0,
) -> CheckResult:
    """Compare `candidate` (in `dtype`) with the torch delta rule per sample in fp32 on one random pack of `lengths`.

    Errors are relative Frobenius norms. The tolerance is ROUNDING_FACTOR × the torch path's largest own error in
    `dtype` over the quantities (its rounding level: a single quantity's own error can be 0, e.g. dg when g stays
    fp32), at least ERROR_FLOOR. Host syncs are fine here: this runs once, before training.
    """
    generator = torch.Generator().manual_seed(seed)
    *inputs, grad_o = delta_rule_inputs(dims, lengths, dtype, device, generator)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    reference = _run(torch_delta_rule_per_sample, inputs, grad_o, cu_seqlens, torch.float32)
    own = _run(torch_delta_rule_per_sample, inputs, grad_o, cu_seqlens, None)
    tested = _run(candidate, inputs, grad_o, cu_seqlens, None)
    torch_errors = {q: _relative(own[q], reference[q]) for q in QUANTITIES}
    tolerance = max(ROUNDING_FACTOR * max(torch_errors.values()), ERROR_FLOOR)
    return CheckResult(
        errors={q: _relative(tested[q], reference[q]) for q in QUANTITIES},
        torch_errors=torch_errors,
        tolerances=dict.fromkeys(QUANTITIES, tolerance),
    )


def cache_path() -> Path:
    """Where passed and failed checks are remembered: $XDG_CACHE_HOME (or ~/.cache)/qwen-vl-packed-train/."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "qwen-vl-packed-train" / "gated_delta_check.json"


def environment_key(dims: GatedDeltaDims, dtype: torch.dtype, device: torch.device) -> str:
    """Everything the candidate's numerics depend on: GPU model, software versions, head dims and dtype."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        gpu = f"{torch.cuda.get_device_name(device)} sm{major}{minor}"
    else:
        gpu = device.type
    versions = " ".join(f"{name}={_version(name)}" for name in ("torch", "triton", "fla-core", "tilelang"))
    shape = f"k{dims.num_k_heads}x{dims.head_k_dim} v{dims.num_v_heads}x{dims.head_v_dim}"
    return f"{gpu} | {versions} | {shape} | {str(dtype).removeprefix('torch.')}"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def cached_check(
    candidate: DeltaRule, dims: GatedDeltaDims, dtype: torch.dtype, device: torch.device
) -> tuple[CheckResult, bool]:
    """`check_delta_rule` on this machine, remembered in `cache_path()` per `environment_key`.

    Returns (result, from_cache). A failed result is remembered too: delete the file to check again.
    """
    path, key = cache_path(), environment_key(dims, dtype, device)
    entries = _read(path)
    if key in entries:
        try:
            return CheckResult(**entries[key]), True
        except TypeError as error:  # an entry of another shape: checked again, and replaced
            log.warning("ignoring unreadable Gated DeltaNet check cache entry in %s (%s)", path, error)
    result = check_delta_rule(candidate, dims, dtype, device)
    entries = _read(path)  # another rank or run may have written meanwhile
    entries[key] = asdict(result)
    _write(path, entries)
    return result, False


def _read(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (json.JSONDecodeError, OSError, UnicodeDecodeError) as error:
        log.warning("ignoring unreadable Gated DeltaNet check cache %s (%s)", path, error)
        return {}
    if not isinstance(entries, dict):
        log.warning("ignoring unreadable Gated DeltaNet check cache %s (JSON %s, not an object)", path, type(entries))
        return {}
    return entries


def _write(path: Path, entries: dict) -> None:
    """Atomic replace, so concurrent ranks never leave a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        json.dump(entries, tmp, indent=1, sort_keys=True)
    os.replace(tmp.name, path)
