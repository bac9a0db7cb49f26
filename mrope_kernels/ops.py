"""Public rotary ops. PLACEHOLDER until the Triton kernels land: dispatches to the reference implementation."""

from mrope_kernels.reference import apply_mrope_reference as apply_mrope
from mrope_kernels.reference import apply_vision_rope_reference as apply_vision_rope

__all__ = ["apply_mrope", "apply_vision_rope"]
