"""A stand-in for the GPU's varlen attention call (`modeling.packed.varlen_kernel`) that runs anywhere, so the CPU
tests reach the code that feeds that call: with separate query and key boundaries (context parallelism: a query
chunk against its document's key prefix) causal masking is aligned bottom-right, as flash-attn and torch's
varlen_attn align it.

`varlen_reference` takes the kernel's arguments and honours every one of them: each query segment
cu_seqlens[i]:cu_seqlens[i+1] attends to its key segment cu_seqlens_k[i]:cu_seqlens_k[i+1] (the query segments when
cu_seqlens_k is None); query row r of a segment of m queries against n keys sees keys j <= r + n - m; the max_seqlen
arguments must bound their segments, as the kernel requires. It computes in fp32 and returns the query's dtype.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def segment_bounds(cu_seqlens: torch.Tensor, total: int, name: str) -> list[tuple[int, int]]:
    """(start, end) of each segment of `cu_seqlens` int (n+1,), checked: starts at 0, ends at `total`, never falls."""
    points = [int(x) for x in cu_seqlens.tolist()]
    if not points or points[0] != 0 or points[-1] != total or any(b < a for a, b in itertools.pairwise(points)):
        raise ValueError(f"{name} {points} must rise from 0 to the {total} rows it splits.")
    return list(itertools.pairwise(points))


def varlen_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scaling: float,
    causal: bool,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """The varlen call's result computed with one SDPA per segment: q (Tq,H,D), k/v (Tk,Hkv,D) → (Tq,H,D) in q's
    dtype. Raises ValueError when the boundaries do not split q and k into as many segments or a max_seqlen falls
    short of its longest segment."""
    queries = segment_bounds(cu_seqlens, query.shape[0], "cu_seqlens")
    keys = queries if cu_seqlens_k is None else segment_bounds(cu_seqlens_k, key.shape[0], "cu_seqlens_k")
    max_seqlen_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
    if len(keys) != len(queries):
        raise ValueError(f"{len(queries)} query segments but {len(keys)} key segments.")
    for bounds, limit, name in ((queries, max_seqlen, "max_seqlen"), (keys, max_seqlen_k, "max_seqlen_k")):
        if max((end - start for start, end in bounds), default=0) > limit:
            raise ValueError(f"{name}={limit} is shorter than the longest of its segments.")
    gqa = query.shape[1] != key.shape[1]
    outputs = []
    for (q_start, q_end), (k_start, k_end) in zip(queries, keys, strict=True):
        q = query[q_start:q_end].float().transpose(0, 1)[None]
        k, v = (t[k_start:k_end].float().transpose(0, 1)[None] for t in (key, value))
        seqlen_q, seqlen_k = q_end - q_start, k_end - k_start
        mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
        if causal:
            mask = mask.tril(seqlen_k - seqlen_q)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs).to(query.dtype)
