"""Qwen chat/vision special tokens and the fixed ids the built-in tiny tokenizer gives them.

The tiny processor (data/tiny_processor.py) reserves ids 0..6 for these, in this order; a model built at random
init for it takes the same ids in its token-id config fields (TINY_CONFIG_TOKEN_IDS, set by core/families.py's
`hf_config`, and written out in recipes/tiny-*.yaml). Real checkpoints and processors bring their own ids.
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
VIDEO_TOKEN_ID = TINY_TOKEN_IDS["<|video_pad|>"]
PAD_ID = TINY_TOKEN_IDS["<|endoftext|>"]
TINY_VOCAB_SIZE = 2048  # the tiny tokenizer's size, special tokens included; tiny model configs use this vocab_size
# The model-config fields that name special tokens, as the tiny tokenizer numbers them: the composite config's
# vision fields, and its text config's (the tiny tokenizer has no bos token).
TINY_CONFIG_TOKEN_IDS = {
    "image_token_id": IMAGE_TOKEN_ID,
    "video_token_id": VIDEO_TOKEN_ID,
    "vision_start_token_id": VISION_START_ID,
    "vision_end_token_id": VISION_END_ID,
}
TINY_TEXT_CONFIG_TOKEN_IDS = {"bos_token_id": None, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
