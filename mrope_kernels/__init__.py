"""Fused Triton rotary kernels for Qwen-VL models (text mRoPE, partial rotary, vision 2-D rope) and the patch
that puts them into transformers' models."""

from mrope_kernels.ops import apply_mrope, apply_vision_rope

__all__ = ["apply_mrope", "apply_vision_rope"]
