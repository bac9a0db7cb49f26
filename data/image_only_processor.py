"""Qwen-VL processors without a video processor, for machines without torchvision.

Every Qwen-VL processor class takes a video processor, and transformers' video processors need torchvision, which
has no build matching every torch (our CPU one included). These subclasses drop `video_processor` from `__init__`,
which is how `ProcessorMixin` discovers its parts; everything image- and text-related is the family's own code.

This file imports nothing but transformers on purpose: `save_pretrained` copies it next to a saved processor
(`register_for_auto_class`), so an export loads anywhere with
`AutoProcessor.from_pretrained(path, trust_remote_code=True)`, without this repository.
"""

from transformers import (
    AutoProcessor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLProcessor,
    Qwen3VLConfig,
    Qwen3VLProcessor,
)


class Qwen2VLImageOnlyProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without a video processor (no torchvision needed)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class Qwen2_5_VLImageOnlyProcessor(Qwen2_5_VLProcessor):
    """Qwen2_5_VLProcessor without a video processor (no torchvision needed)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


class Qwen3VLImageOnlyProcessor(Qwen3VLProcessor):
    """Qwen3VLProcessor (used by Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE) without a video processor."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


for _config_class, _processor_class in (
    (Qwen2VLConfig, Qwen2VLImageOnlyProcessor),
    (Qwen2_5_VLConfig, Qwen2_5_VLImageOnlyProcessor),
    (Qwen3VLConfig, Qwen3VLImageOnlyProcessor),
):
    AutoProcessor.register(_config_class, _processor_class, exist_ok=True)
    _processor_class.register_for_auto_class("AutoProcessor")
