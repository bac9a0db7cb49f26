"""Plain-PyTorch reference rotary for every flavour the kernels implement (same signatures as the public API).

Math follows transformers exactly: rotate-half pairs (lane i pairs with lane i + R/2), angles from integer
positions times `inv_freq` in fp32, `attention_scaling` applied to cos and sin. Unlike transformers' text path,
cos/sin are never rounded to the activation dtype: the rotation runs in fp32 and only the result is cast.
Used on CPU without the Triton interpreter, by the tests, and by the benchmarks.
"""

from __future__ import annotations

import torch


def mrope_lane_axes(mrope_section: tuple[int, int, int] | list[int], interleaved: bool, device=None) -> torch.Tensor:
    """Axis (0 = temporal, 1 = height, 2 = width) that drives each of the R/2 frequency lanes.

    Chunked (Qwen2/2.5-VL): lanes [0, s0) temporal, [s0, s0+s1) height, the rest width.
    Interleaved (Qwen3-VL, Qwen3.5): lane j is height if j % 3 == 1 and j < 3*s1, width if j % 3 == 2 and
    j < 3*s2, else temporal — transformers' `recomposition_frequencies` layout.
    """
    half = sum(mrope_section)
    lane = torch.arange(half, device=device)
    if interleaved:
        axes = torch.zeros(half, dtype=torch.long, device=device)
        axes[(lane % 3 == 1) & (lane < 3 * mrope_section[1])] = 1
        axes[(lane % 3 == 2) & (lane < 3 * mrope_section[2])] = 2
        return axes
    bounds = torch.tensor([mrope_section[0], mrope_section[0] + mrope_section[1]], device=device)
    return torch.bucketize(lane, bounds, right=True)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first R = cos.shape[-1] lanes of x (fp32 math), pass the rest through; dtype of x."""
    rot = cos.shape[-1]
    x_rot = x[..., :rot].float()
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated.to(x.dtype), x[..., rot:]), dim=-1)


def mrope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, mrope_section, interleaved: bool) -> torch.Tensor:
    """fp32 angles (*lead, R/2): lane j uses the position of its axis times inv_freq[j]."""
    axes = mrope_lane_axes(mrope_section, interleaved, device=positions.device)
    pos = positions.float()  # (3, *lead)
    per_lane_pos = pos.movedim(0, -1)[..., axes]  # (*lead, R/2)
    return per_lane_pos * inv_freq.float()


def apply_mrope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section,
    interleaved: bool = False,
    attention_scaling: float = 1.0,
    *,
    heads_first: bool = False,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Text mRoPE. q (T, Hq, D) or (B, S, Hq, D), or (B, Hq, S, D) with heads_first; k the same leading dims with Hk
    heads; positions int (3, T) or (3, B, S); inv_freq fp32 (R/2,) with R <= D; lanes [R, D) pass through. Returns
    (q_out, k_out) in q/k dtype and layout; with inplace, q and k themselves, rotated (autograd records the copy)."""
    angles = mrope_angles(positions, inv_freq, mrope_section, interleaved)
    emb = torch.cat((angles, angles), dim=-1).unsqueeze(-2)  # (*lead, 1, R)
    cos, sin = emb.cos() * attention_scaling, emb.sin() * attention_scaling
    if heads_first:
        cos, sin = cos.transpose(-3, -2), sin.transpose(-3, -2)  # (B, 1, S, R)
    q_out, k_out = _rotate(q, cos, sin), _rotate(k, cos, sin)
    return (q.copy_(q_out), k.copy_(k_out)) if inplace else (q_out, k_out)


def apply_vision_rope_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vision 2-D rope. q, k (T, H, D); positions int (T, 2) [row, col]; inv_freq fp32 (D/4,).

    Lanes [0, D/4) use row * inv_freq, lanes [D/4, D/2) use col * inv_freq (the index restarts per axis), and
    the second half of the head mirrors the first (rotate-half pairs), as transformers' vision rotary does.
    """
    angles = (positions.float()[..., None] * inv_freq.float()).flatten(-2)  # (T, D/2)
    emb = torch.cat((angles, angles), dim=-1).unsqueeze(-2)  # (T, 1, D)
    cos, sin = emb.cos(), emb.sin()
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotate_by_vision_table_reference(
    q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, conjugate: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vision 2-D rope by a (T, D) `ops.vision_rope_table` (cos in columns [0, D/2), sin in [D/2, D)): the same
    rotation as `apply_vision_rope_reference`, by -angle when conjugate."""
    half = table.shape[-1] // 2
    cos, sin = table[:, :half], table[:, half:]
    sin = -sin if conjugate else sin
    cos, sin = (torch.cat((t, t), dim=-1).unsqueeze(-2) for t in (cos, sin))  # (T, 1, D)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
