"""`data.max_visual_tokens`: a sample's images and videos fitted to a visual-token budget instead of skipped.

A sample's visual tokens are the LLM tokens of its images and videos (ViT patches / merge²). Over the budget:
1. videos lose frames: one frame cap for all of the sample's videos, the largest that fits, down to one temporal
   patch each (the frames stay evenly spread over the whole video, data/video.py);
2. then every image and video frame shrinks by one common pixel factor, the largest that fits: each size comes from
   the image processor's own rule (transformers' `smart_resize`: aspect ratio kept, sides multiples of
   patch × merge), called with lowered pixel bounds, which the collator passes to the image processor in turn.
A sample whose smallest form (one temporal patch per video, one merge window per image or frame) is still over the
budget cannot fit: `fit_visuals` returns None and the sample is a counted skip (`visual_tokens_over_budget`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

SCALE_STEPS = 40  # bisection steps of the common pixel factor: far below one pixel of any image


@dataclass(frozen=True)
class Visual:
    """One image or video as the budget sees it: its source size in pixels (a video's frame size), the resize
    bounds it is processed with, and for a video its sampled frame count and frame cap (0 for an image)."""

    height: int
    width: int
    min_pixels: int
    max_pixels: int
    frames: int = 0
    max_frames: int = 0

    def resized(self, factor: int) -> tuple[int, int]:
        """(height, width) after the image processor's resize (multiples of `factor` = patch × merge)."""
        return smart_resize(
            self.height, self.width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels
        )

    def tokens(self, factor: int, temporal_patch_size: int) -> int:
        """LLM tokens: merge windows per frame group × temporal patches (1 for an image)."""
        height, width = self.resized(factor)
        groups = -(-self.frames // temporal_patch_size) if self.frames else 1
        return groups * (height // factor) * (width // factor)


def visual_tokens(visuals: list[Visual], factor: int, temporal_patch_size: int) -> int:
    return sum(visual.tokens(factor, temporal_patch_size) for visual in visuals)


def _capped_frames(visuals: list[Visual], cap: int) -> list[Visual]:
    """Every video with more than `cap` frames sampled at `cap` frames (its frame cap lowered to it)."""
    return [
        dataclasses.replace(visual, frames=cap, max_frames=cap) if visual.frames > cap else visual for visual in visuals
    ]


def _scaled(visuals: list[Visual], scale: float, factor: int) -> list[Visual]:
    """Every visual's upper pixel bound set to `scale` × its current resized pixels (at least one merge window),
    its lower bound at most that."""
    out = []
    for visual in visuals:
        height, width = visual.resized(factor)
        cap = max(factor * factor, math.floor(scale * height * width))
        out.append(dataclasses.replace(visual, min_pixels=min(visual.min_pixels, cap), max_pixels=cap))
    return out


def _largest_scale(fits: Callable[[float], bool]) -> float:
    """The largest scale in [0, 1] that `fits` (bisection, `fits(0)` true), to SCALE_STEPS halvings."""
    low, high = 0.0, 1.0
    for _ in range(SCALE_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def fit_visuals(visuals: list[Visual], budget: int, factor: int, temporal_patch_size: int) -> list[Visual] | None:
    """`visuals` (in the sample's order) within `budget` visual tokens: unchanged when they fit, else with fewer
    video frames, then smaller (module docstring); None when even the smallest form exceeds the budget."""

    def fits(candidate: list[Visual]) -> bool:
        return visual_tokens(candidate, factor, temporal_patch_size) <= budget

    if fits(visuals):
        return visuals
    most_frames = max((visual.frames for visual in visuals), default=0)
    fewest = min(temporal_patch_size, most_frames)
    for cap in range(most_frames - 1, fewest - 1, -1):  # a cheap scan: a video has at most a few hundred frames
        candidate = _capped_frames(visuals, cap)
        if fits(candidate):
            return candidate
    visuals = _capped_frames(visuals, fewest)
    if not fits(_scaled(visuals, 0.0, factor)):
        return None
    scale = _largest_scale(lambda s: fits(_scaled(visuals, s, factor)))
    return _scaled(visuals, scale, factor)
