"""Fused Triton rotary kernels for Qwen-VL models (text mRoPE, partial rotary, vision 2-D rope) and the patch
that puts them into transformers' models."""

from mrope_kernels.ops import apply_mrope, apply_vision_rope, apply_vision_rope_table, vision_rope_table
from mrope_kernels.patch import PatchError, PatchReport, apply_rope_choice, patch_model, unpatch_model

__all__ = [
    "PatchError",
    "PatchReport",
    "apply_mrope",
    "apply_rope_choice",
    "apply_vision_rope",
    "apply_vision_rope_table",
    "patch_model",
    "unpatch_model",
    "vision_rope_table",
]
