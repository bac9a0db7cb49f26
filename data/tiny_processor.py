"""The offline tiny processor: a BPE tokenizer trained here, the Qwen chat template, the family's image processor.

The processor classes are the image-only ones of data/image_only_processor.py (no torchvision needed); a saved tiny
processor carries that file, so it loads with `AutoProcessor.from_pretrained(dir, trust_remote_code=True)`
anywhere, and without the flag in a process that imported this package. Videos go through the image processor
frame by frame (data/video.py); the chat template renders them as the Qwen templates do.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoProcessor, PretrainedConfig, PreTrainedTokenizerFast, Qwen2VLImageProcessorPil

from core.caches import built_directory
from core.families import FAMILIES
from core.special_tokens import SPECIAL_TOKENS, TINY_VOCAB_SIZE
from data import image_only_processor
from data.synthetic import corpus_texts

# Qwen2's pre-tokenizer split (digits one at a time, words with a leading space), then byte-level BPE.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The Qwen2-VL chat template (system default, images as <|vision_start|><|image_pad|><|vision_end|>, videos as
# <|vision_start|><|video_pad|><|vision_end|>).
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_MIN_TOKENS, TINY_MAX_TOKENS = 16, 256  # LLM tokens per image after the 2x2 merge
TINY_PROCESSOR_VERSION = 3  # part of the cache directory's name: bump when the template or tokenizer changes


def image_only_processor_class(model_type: str) -> type:
    """The family's image-only processor class (data/image_only_processor.py); ValueError for an unknown family."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"no image-only processor for model_type {model_type!r}.")
    return getattr(image_only_processor, family.processor)


def train_tiny_tokenizer(texts: list[str], vocab_size: int = TINY_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts`, with SPECIAL_TOKENS at ids 0..6 in order; at most `vocab_size` ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"tokenizers gave {token} id {tokenizer.token_to_id(token)}, expected {token_id}.")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=1 << 20,
    )


def vision_geometry(model_config: PretrainedConfig) -> tuple[int, int, int]:
    """(patch_size, spatial_merge_size, temporal_patch_size) of the model's vision tower."""
    vision = model_config.vision_config
    return vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size


def build_tiny_processor(model_config: PretrainedConfig):
    """A fresh tiny processor for `model_config`'s family and vision geometry (trains the tokenizer)."""
    processor_class = image_only_processor_class(model_config.model_type)
    patch_size, merge_size, temporal_patch_size = vision_geometry(model_config)
    pixels_per_token = (patch_size * merge_size) ** 2
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        merge_size=merge_size,
        temporal_patch_size=temporal_patch_size,
        min_pixels=TINY_MIN_TOKENS * pixels_per_token,
        max_pixels=TINY_MAX_TOKENS * pixels_per_token,
    )
    tokenizer = train_tiny_tokenizer(corpus_texts())
    return processor_class(image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN_CHAT_TEMPLATE)


def tiny_processor_dir(cache_root: str | os.PathLike, model_config: PretrainedConfig) -> Path:
    """Where the tiny processor for this family and vision geometry is cached."""
    patch_size, merge_size, temporal_patch_size = vision_geometry(model_config)
    name = image_only_processor_class(model_config.model_type).__name__
    return (
        Path(cache_root)
        / f"tiny-processor-v{TINY_PROCESSOR_VERSION}-{name}-p{patch_size}m{merge_size}t{temporal_patch_size}"
    )


def _save_tiny_processor(directory: Path, model_config: PretrainedConfig) -> None:
    build_tiny_processor(model_config).save_pretrained(directory)


def load_or_build_tiny_processor(cache_root: str | os.PathLike, model_config: PretrainedConfig):
    """The cached tiny processor, built and saved first when it is missing or its files do not match their
    manifest (core/caches.py: rebuilt with one warning line); loaded back through AutoProcessor."""
    save = functools.partial(_save_tiny_processor, model_config=model_config)
    directory = built_directory(tiny_processor_dir(cache_root, model_config), save, "the tiny processor")
    return AutoProcessor.from_pretrained(directory)
