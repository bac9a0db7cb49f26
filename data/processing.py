"""One record → one training sample: chat template, image grids, assistant-only labels, per-sample positions.

`SampleProcessor(record, index)` returns a flat dict (the columns of PROCESSED_FEATURES) so it can run inside
`datasets.map(num_proc=…)`, cached; a bad record comes back with `skip_reason` set instead of raising.
Pixel values are not stored (a few MB per image); the collator recomputes them from `images`, which the image
processor does deterministically, and checks the grid matches the one stored here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import jinja2
import torch
from datasets import Features, List, Value
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from data.formats import DataError, SampleError, load_image, normalize_record, resolve_ref
from data.positions import rope_index_fn

IGNORE_INDEX = -100
RECORD_JSON_COLUMN = "__record_json__"  # JSON files are read as one JSON string per record (schema-free)
RECORD_LOCATION_COLUMN = "__location__"  # "line 7" / "item 7" (1-based), so a skip names where the record is
RECORD_JSON_FEATURES = Features(
    {
        RECORD_JSON_COLUMN: Value("string"),  # null: the line is not valid UTF-8
        RECORD_LOCATION_COLUMN: Value("string"),
    }
)

PROCESSED_FEATURES = Features(
    {
        "sample_id": Value("string"),
        "skip_reason": Value("string"),  # "" for a kept sample, else one of formats.SKIP_REASONS
        "skip_detail": Value("string"),
        "input_ids": List(Value("int32")),  # (L,)
        "labels": List(Value("int32")),  # (L,) token id where trained (assistant turns), else -100; unshifted
        "mrope_positions": List(List(Value("int32"))),  # (3, L) from the model's get_rope_index on this sample
        "image_grid_thw": List(List(Value("int32"))),  # (n_images, 3)
        "images": List({"path": Value("string"), "bytes": Value("binary")}),  # resolved references, in order
        "length": Value("int32"),  # L
        "num_patches": Value("int32"),  # ViT patches of all images (before the merger)
    }
)


def image_size_kwargs(image_processor, min_pixels: int | None, max_pixels: int | None) -> dict:
    """Call kwargs overriding the image processor's pixel bounds (empty when the recipe sets none)."""
    if min_pixels is None and max_pixels is None:
        return {}
    size = image_processor.size
    shortest = min_pixels if min_pixels is not None else size["shortest_edge"]
    longest = max_pixels if max_pixels is not None else size["longest_edge"]
    return {"size": {"shortest_edge": shortest, "longest_edge": longest}}


def _storable(text: str) -> str:
    """`text` with lone surrogates (from JSON "\\ud800" escapes) escaped: arrow stores only valid UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _skipped(sample_id: str, error: SampleError) -> dict:
    return {
        "sample_id": sample_id,
        "skip_reason": error.reason,
        "skip_detail": _storable(error.detail),
        "input_ids": [],
        "labels": [],
        "mrope_positions": [],
        "image_grid_thw": [],
        "images": [],
        "length": 0,
        "num_patches": 0,
    }


def _parsed(record: Mapping) -> Mapping:
    """The record itself, or the JSON object a raw-line column holds; a malformed line is an unknown format."""
    if RECORD_JSON_COLUMN not in record:
        return record
    text = record[RECORD_JSON_COLUMN]
    if text is None:
        raise SampleError("undecodable_line", "the line is not valid UTF-8")
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as error:
        raise SampleError("unknown_format", f"the line is not valid JSON ({error})") from None
    except RecursionError:  # json recurses once per nesting level
        raise SampleError("malformed_record", "the line nests JSON deeper than Python's recursion limit") from None
    if not isinstance(parsed, dict):
        raise SampleError("unknown_format", f"the line is JSON {type(parsed).__name__}, not an object")
    return parsed


class SampleProcessor:
    """Picklable per-record function for `datasets.map(..., with_indices=True)`.

    Args: processor (a Qwen-VL processor: tokenizer, image_processor, chat template), model_config (the HF config;
    its get_rope_index makes the positions), data_format ('auto'|'llava'|'messages'), image_root (for relative
    paths), min_pixels / max_pixels (image bounds; None keeps the processor's), raise_errors (on_error: raise).
    """

    def __init__(
        self,
        processor,
        model_config,
        data_format: str = "auto",
        image_root: str | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        raise_errors: bool = False,
    ):
        self.processor = processor
        self.model_config = model_config
        self.data_format = data_format
        self.image_root = image_root
        self.image_kwargs = image_size_kwargs(processor.image_processor, min_pixels, max_pixels)
        self.raise_errors = raise_errors
        self.tokenizer = processor.tokenizer
        self.image_token_id = model_config.image_token_id
        self.merge_size = model_config.vision_config.spatial_merge_size
        self._rope_index = None  # built lazily in each worker (not pickled)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_rope_index": None}

    def __call__(self, record: Mapping, index: int) -> dict:
        location = record.get(RECORD_LOCATION_COLUMN) or f"row {index + 1}"
        sample_id = location
        try:
            record = _parsed(record)
            sample_id = _storable(str(record.get("id", location)))
            return self.process(record, sample_id)
        except SampleError as error:
            if self.raise_errors:
                raise DataError(f"sample {sample_id} ({location}): {error} (data.on_error=skip skips it)") from None
            if sample_id != location:  # a record with an id: say where it is too
                error.detail = f"{location}: {error.detail}"
            return _skipped(sample_id, error)

    def image_files(self, record: Mapping) -> list[str]:
        """The image files a record would load, resolved as `process` resolves them (none for a bad record)."""
        try:
            _, refs = normalize_record(_parsed(record), self.data_format)
        except SampleError:
            return []
        refs = [resolve_ref(ref, self.image_root) for ref in refs]
        return [ref["path"] for ref in refs if ref["bytes"] is None and ref["path"]]

    def process(self, record: Mapping, sample_id: str) -> dict:
        messages, refs = normalize_record(record, self.data_format)
        refs = [resolve_ref(ref, self.image_root) for ref in refs]
        images = [load_image(ref) for ref in refs]
        grids = self.image_grids(images)
        input_ids, labels = self.tokenize(messages, grids)
        ids = torch.tensor(input_ids, dtype=torch.long)[None]
        token_types = (ids == self.image_token_id).int()
        grid_tensor = torch.tensor(grids, dtype=torch.long) if grids else None
        if self._rope_index is None:
            self._rope_index = rope_index_fn(self.model_config)
        positions = self._rope_index(ids, token_types, grid_tensor)
        return {
            "sample_id": sample_id,
            "skip_reason": "",
            "skip_detail": "",
            "input_ids": input_ids,
            "labels": labels,
            "mrope_positions": positions.tolist(),
            "image_grid_thw": grids,
            "images": refs,
            "length": len(input_ids),
            "num_patches": sum(t * h * w for t, h, w in grids),
        }

    def image_grids(self, images: list) -> list[list[int]]:
        """(t, h, w) patch grid per image, from the image processor's own resize rule (smart_resize) without
        running it; the collator checks these grids against the processor's output on every batch."""
        image_processor = self.processor.image_processor
        size = self.image_kwargs.get("size", image_processor.size)
        patch, merge = image_processor.patch_size, image_processor.merge_size
        grids = []
        for image in images:
            try:
                height, width = smart_resize(
                    image.height,
                    image.width,
                    factor=patch * merge,
                    min_pixels=size["shortest_edge"],
                    max_pixels=size["longest_edge"],
                )
            except ValueError as error:  # e.g. an aspect ratio beyond 200: the processor cannot use the image
                raise SampleError("corrupt_image", f"{image.width}x{image.height} image: {error}") from None
            grids.append([1, height // patch, width // patch])
        return grids

    def render_segments(self, messages: list[dict]) -> list[tuple[str, bool]]:
        """The chat-template text cut into (text, is_assistant_reply) pieces.

        An assistant reply is the text between the template's generation prompt and the end of that turn, closing
        <|im_end|> included (the model must learn to stop); the newline after it belongs to the next piece.
        """
        try:
            return self._render_segments(messages)
        except jinja2.TemplateError as error:  # a template that refuses this conversation (e.g. raise_exception)
            raise SampleError("unknown_format", f"the chat template rejects the conversation: {error}") from None

    def _render_segments(self, messages: list[dict]) -> list[tuple[str, bool]]:
        template = self.processor.apply_chat_template
        full = template(messages, tokenize=False)
        segments, cursor = [], 0
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if turn == 0:
                raise SampleError("unknown_format", "the conversation opens with an assistant turn: nothing prompts it")
            prompt = template(messages[:turn], tokenize=False, add_generation_prompt=True)
            through = template(messages[: turn + 1], tokenize=False)
            if not (full.startswith(through) and through.startswith(prompt) and len(prompt) >= cursor):
                raise SampleError(
                    "unknown_format",
                    f"the chat template's rendering of turns 1..{turn} is not a prefix of turns 1..{turn + 1}, so the "
                    "assistant reply cannot be located (a template that rewrites earlier turns)",
                )
            end = len(through.rstrip("\n"))
            segments += [(full[cursor : len(prompt)], False), (full[len(prompt) : end], True)]
            cursor = end
        segments.append((full[cursor:], False))
        return [(text, trained) for text, trained in segments if text]

    def tokenize(self, messages: list[dict], grids: list[list[int]]) -> tuple[list[int], list[int]]:
        """(input_ids, labels), each (L,), with every image placeholder expanded to its LLM token count."""
        segments = self.render_segments(messages)
        backend = self.tokenizer.backend_tokenizer  # one call per piece: encode_batch's thread pool costs more here
        encoded = [backend.encode(text, add_special_tokens=False).ids for text, _ in segments]
        tokens_per_image = iter(t * h * w // self.merge_size**2 for t, h, w in grids)
        input_ids, labels = [], []
        for (_, trained), ids in zip(segments, encoded, strict=True):
            for token in ids:
                count = next(tokens_per_image, None) if token == self.image_token_id else 1
                if count is None:
                    raise SampleError("image_count_mismatch", "the template produced more image tokens than images")
                input_ids += [token] * count
                labels += [token if trained else IGNORE_INDEX] * count
        if next(tokens_per_image, None) is not None:
            raise SampleError("image_count_mismatch", "the template produced fewer image tokens than images")
        return input_ids, labels
