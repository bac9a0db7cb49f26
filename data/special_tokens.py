"""Qwen chat/vision special tokens and the fixed ids the built-in tiny tokenizer gives them.

The tiny processor (data/tiny_processor.py) reserves ids 0..6 for these, in this order, and the tiny model recipes
(recipes/tiny-*.yaml) use the same ids for their token-id config fields. Real checkpoints bring their own ids.
"""

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
TINY_TOKEN_IDS = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
EOS_ID = TINY_TOKEN_IDS["<|im_end|>"]
VISION_START_ID = TINY_TOKEN_IDS["<|vision_start|>"]
VISION_END_ID = TINY_TOKEN_IDS["<|vision_end|>"]
IMAGE_TOKEN_ID = TINY_TOKEN_IDS["<|image_pad|>"]
TINY_VOCAB_SIZE = 2048  # the tiny tokenizer's size, special tokens included; tiny model configs use this vocab_size
