"""One record → one training sample: chat template, image and video grids, assistant-only labels, positions.

`SampleProcessor(record, index)` returns a flat dict (the columns of PROCESSED_FEATURES) so it can run inside
`datasets.map(num_proc=…)`, cached; a bad record comes back with `skip_reason` set instead of raising.
Pixel values are not stored (a few MB per image); the collator recomputes them from `images` and `videos`, which
the image processor (and the deterministic frame sampling of data/video.py) does identically, and checks the grids
match the ones stored here. A video's placeholder expands as the family's processor expands it: Qwen2/2.5-VL one
run of video tokens; Qwen3-VL/3.5 per temporal patch "<t seconds>" + vision_start + its tokens + vision_end.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import jinja2
import torch
from datasets import Features, List, Value
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from data.config import DataConfig
from data.formats import DataError, SampleError, load_image, normalize_record, resolve_ref
from data.positions import rope_index_fn
from data.video import (
    VideoSettings,
    grid_timestamps,
    load_clip,
    resolve_video,
    second_per_grid,
    uses_timestamps,
    video_grid,
)

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
        "video_grid_thw": List(List(Value("int32"))),  # (n_videos, 3)
        "videos": List(  # resolved video references (data/video.py), in order
            {
                "path": Value("string"),
                "bytes": Value("binary"),
                "frames": List({"path": Value("string"), "bytes": Value("binary")}),
            }
        ),
        "second_per_grid_ts": List(Value("float64")),  # (n_videos,) seconds per temporal patch
        "length": Value("int32"),  # L
        "num_patches": Value("int32"),  # ViT patches of all images and videos (before the merger)
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
        "video_grid_thw": [],
        "videos": [],
        "second_per_grid_ts": [],
        "length": 0,
        "num_patches": 0,
    }


def parse_record(record: Mapping) -> Mapping:
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
    paths), min_pixels / max_pixels (image bounds; None keeps the processor's), video (VideoSettings; None: the
    defaults of data.config.DataConfig), raise_errors (on_error: raise).
    """

    def __init__(
        self,
        processor,
        model_config,
        data_format: str = "auto",
        image_root: str | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        video: VideoSettings | None = None,
        raise_errors: bool = False,
    ):
        self.processor = processor
        self.model_config = model_config
        self.data_format = data_format
        self.image_root = image_root
        self.image_kwargs = image_size_kwargs(processor.image_processor, min_pixels, max_pixels)
        defaults = DataConfig(min_pixels=min_pixels, max_pixels=max_pixels)
        self.video = video or VideoSettings.from_config(defaults, processor.image_processor)
        self.raise_errors = raise_errors
        self.tokenizer = processor.tokenizer
        self.image_token_id = model_config.image_token_id
        self.video_token_id = model_config.video_token_id
        self.merge_size = model_config.vision_config.spatial_merge_size
        self.temporal_patch_size = processor.image_processor.temporal_patch_size
        self.timestamps = uses_timestamps(model_config)
        self._rope_index = None  # built lazily in each worker (not pickled)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_rope_index": None}

    def __call__(self, record: Mapping, index: int) -> dict:
        location = record.get(RECORD_LOCATION_COLUMN) or f"row {index + 1}"
        sample_id = location
        try:
            record = parse_record(record)
            sample_id = _storable(str(record.get("id", location)))
            return self.process(record, sample_id)
        except SampleError as error:
            if self.raise_errors:
                raise DataError(f"sample {sample_id} ({location}): {error} (data.on_error=skip skips it)") from None
            if sample_id != location:  # a record with an id: say where it is too
                error.detail = f"{location}: {error.detail}"
            return _skipped(sample_id, error)

    def image_files(self, record: Mapping) -> list[str]:
        """The image, video and video-frame files a record would load, resolved as `process` resolves them (none
        for a bad record)."""
        try:
            _, refs, video_refs = normalize_record(parse_record(record), self.data_format)
        except SampleError:
            return []
        refs = [resolve_ref(ref, self.image_root) for ref in refs]
        for video in video_refs:
            resolved = resolve_video(video, self.image_root)
            refs += [resolved, *resolved["frames"]]
        return [ref["path"] for ref in refs if ref["bytes"] is None and ref["path"]]

    def process(self, record: Mapping, sample_id: str) -> dict:
        messages, refs, video_refs = normalize_record(record, self.data_format)
        refs = [resolve_ref(ref, self.image_root) for ref in refs]
        images = [load_image(ref) for ref in refs]
        grids = self.image_grids(images)
        video_refs = [resolve_video(ref, self.image_root) for ref in video_refs]
        clips = [load_clip(ref, self.video.fps, self.video.max_frames) for ref in video_refs]
        video_grids = [video_grid(self.processor.image_processor, self.video.size_kwargs, clip) for clip in clips]
        seconds = [second_per_grid(clip, self.temporal_patch_size) for clip in clips]
        expansions = [self.video_tokens(clip, grid) for clip, grid in zip(clips, video_grids, strict=True)]
        input_ids, labels = self.tokenize(messages, grids, expansions)
        ids = torch.tensor(input_ids, dtype=torch.long)[None]
        token_types = (ids == self.image_token_id).int() + 2 * (ids == self.video_token_id).int()
        if self._rope_index is None:
            self._rope_index = rope_index_fn(self.model_config)
        positions = self._rope_index(
            ids,
            token_types,
            torch.tensor(grids, dtype=torch.long) if grids else None,
            torch.tensor(video_grids, dtype=torch.long) if video_grids else None,
            torch.tensor(seconds, dtype=torch.float64) if seconds else None,
        )
        return {
            "sample_id": sample_id,
            "skip_reason": "",
            "skip_detail": "",
            "input_ids": input_ids,
            "labels": labels,
            "mrope_positions": positions.tolist(),
            "image_grid_thw": grids,
            "images": refs,
            "video_grid_thw": video_grids,
            "videos": video_refs,
            "second_per_grid_ts": seconds,
            "length": len(input_ids),
            "num_patches": sum(t * h * w for t, h, w in grids + video_grids),
        }

    def video_tokens(self, clip, grid: list[int]) -> list[int]:
        """The token ids a video's placeholder token expands to, as the family's processor writes them."""
        t, h, w = grid
        per_patch = h * w // self.merge_size**2
        if not self.timestamps:
            return [self.video_token_id] * (t * per_patch)
        encode = self.tokenizer.backend_tokenizer.encode
        start, end = self.model_config.vision_start_token_id, self.model_config.vision_end_token_id
        tokens = []
        # The stamps sit between special tokens, which the tokenizer never merges across: encoding one alone gives
        # the same ids as encoding the processor's whole expanded prompt.
        for seconds in grid_timestamps(clip, self.temporal_patch_size):
            stamp = encode(f"<{seconds:.1f} seconds>", add_special_tokens=False).ids
            tokens += [*stamp, start, *[self.video_token_id] * per_patch, end]
        return tokens

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

    def tokenize(
        self, messages: list[dict], grids: list[list[int]], videos: list[list[int]] = ()
    ) -> tuple[list[int], list[int]]:
        """(input_ids, labels), each (L,), with every image placeholder expanded to its LLM token count and every
        video placeholder to its token ids in `videos` (one list per video, `video_tokens`)."""
        segments = self.render_segments(messages)
        backend = self.tokenizer.backend_tokenizer  # one call per piece: encode_batch's thread pool costs more here
        encoded = [backend.encode(text, add_special_tokens=False).ids for text, _ in segments]
        tokens_per_image = iter(t * h * w // self.merge_size**2 for t, h, w in grids)
        video_ids = iter(videos)
        input_ids, labels = [], []
        for (_, trained), ids in zip(segments, encoded, strict=True):
            for token in ids:
                if token == self.video_token_id:
                    expanded = next(video_ids, None)
                    if expanded is None:
                        raise SampleError("video_count_mismatch", "the template produced more video tokens than videos")
                else:
                    count = next(tokens_per_image, None) if token == self.image_token_id else 1
                    if count is None:
                        raise SampleError("image_count_mismatch", "the template produced more image tokens than images")
                    expanded = [token] * count
                input_ids += expanded
                labels += expanded if trained else [IGNORE_INDEX] * len(expanded)
        if next(tokens_per_image, None) is not None:
            raise SampleError("image_count_mismatch", "the template produced fewer image tokens than images")
        if next(video_ids, None) is not None:
            raise SampleError("video_count_mismatch", "the template produced fewer video tokens than videos")
        return input_ids, labels
