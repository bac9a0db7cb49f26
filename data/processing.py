"""One record → one training sample: chat template, image and video grids, assistant-only labels, positions.

`SampleProcessor(record, index)` returns a flat dict (the columns of PROCESSED_FEATURES) so it can run inside
`datasets.map(num_proc=…)`, cached; a bad record comes back with `skip_reason` set instead of raising.
Pixel values are not stored (a few MB per image); the collator recomputes them from `images` and `videos`, which
the image processor (and the deterministic frame sampling of data/video.py) does identically, and checks the grids
match the ones stored here. A video's placeholder expands as the family's processor expands it: Qwen2/2.5-VL one
run of video tokens; Qwen3-VL/3.5 per temporal patch "<t seconds>" + vision_start + its tokens + vision_end.
With data.max_visual_tokens, a sample's images and videos are first fitted to that budget (`fit_visuals`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jinja2
import torch
from datasets import Features, List, Value
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from core.data_config import DataConfig
from data.formats import (
    DataError,
    SampleError,
    load_image,
    normalize_record,
    normalized_record,
    resolve_ref,
    resolve_video,
)
from data.positions import rope_index_fn
from data.video import (
    VideoSettings,
    grid_timestamps,
    load_clip,
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
        # How the collator remakes the pixels: each image's resize bounds [min_pixels, max_pixels], each video's
        # sampling and per-frame bounds (the source's settings, or smaller ones from data.max_visual_tokens).
        "image_sizes": List(List(Value("int64"))),  # (n_images, 2)
        "video_settings": List(
            {
                "fps": Value("float64"),
                "max_frames": Value("int32"),
                "min_pixels": Value("int64"),
                "max_pixels": Value("int64"),
            }
        ),
        "length": Value("int32"),  # L
        "num_patches": Value("int32"),  # ViT patches of all images and videos (before the merger)
        # the record had media but no placeholders, and got them in front of its first user turn (formats.py)
        "placeholders_added": Value("bool"),
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


def size_bounds(image_processor, size_kwargs: dict) -> tuple[int, int]:
    """(min_pixels, max_pixels) of image-processor call kwargs (the processor's own when they set none)."""
    size = size_kwargs.get("size", image_processor.size)
    return size["shortest_edge"], size["longest_edge"]


def bounds_kwargs(min_pixels: int, max_pixels: int) -> dict:
    """Image-processor call kwargs for these pixel bounds."""
    return {"size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}


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
    """`visuals` (in the sample's order) within `budget` visual tokens (data.max_visual_tokens): unchanged when they
    fit; None when even the smallest form exceeds the budget.

    A sample's visual tokens are the LLM tokens of its images and videos (ViT patches / merge²). Over the budget:
    1. videos lose frames: one frame cap for all of the sample's videos, the largest that fits, down to one temporal
       patch each (the frames stay evenly spread over the whole video, data/video.py);
    2. then every image and video frame shrinks by one common pixel factor, the largest that fits: each size comes from
       the image processor's own rule (transformers' `smart_resize`: aspect ratio kept, sides multiples of
       patch × merge), called with lowered pixel bounds, which the collator passes to the image processor in turn.
    A sample whose smallest form (one temporal patch per video; each image or frame under a pixel cap of one merge
    window, which smart_resize makes one window, or a few for a long thin or tiny one) is still over the budget cannot
    fit: `fit_visuals` returns None and the sample is a counted skip (`visual_tokens_over_budget`).
    """

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


def _storable(text: str) -> str:
    """`text` with lone surrogates (from JSON "\\ud800" escapes) escaped: arrow stores only valid UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def empty_row(**fields) -> dict:
    """A row of PROCESSED_FEATURES with no tokens, image or video (every list column [], every number 0, every text
    "", every flag false), with `fields` set; a field PROCESSED_FEATURES does not have is a KeyError."""
    blank = {"string": "", "bool": False}
    row = {
        name: [] if isinstance(feature, List) else blank.get(feature.dtype, 0)
        for name, feature in PROCESSED_FEATURES.items()
    }
    unknown = sorted(set(fields) - set(row))
    if unknown:
        raise KeyError(f"{unknown} are not processed-row columns (PROCESSED_FEATURES)")
    return {**row, **fields}


def _skipped(sample_id: str, error: SampleError) -> dict:
    return empty_row(sample_id=sample_id, skip_reason=error.reason, skip_detail=_storable(error.detail))


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
    defaults of core.data_config.DataConfig), raise_errors (on_error: raise), max_visual_tokens (per-sample budget of
    image and video tokens, `fit_visuals`; None: no budget).
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
        max_visual_tokens: int | None = None,
    ):
        self.processor = processor
        self.model_config = model_config
        self.data_format = data_format
        self.image_root = image_root
        self.image_kwargs = image_size_kwargs(processor.image_processor, min_pixels, max_pixels)
        defaults = DataConfig(min_pixels=min_pixels, max_pixels=max_pixels)
        self.video = video or VideoSettings.from_config(defaults, processor.image_processor)
        self.raise_errors = raise_errors
        self.max_visual_tokens = max_visual_tokens
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
        messages, refs, video_refs, placeholders_added = normalized_record(record, self.data_format)
        refs = [resolve_ref(ref, self.image_root) for ref in refs]
        images = [load_image(ref) for ref in refs]
        video_refs = [resolve_video(ref, self.image_root) for ref in video_refs]
        clips = [load_clip(ref, self.video.fps, self.video.max_frames) for ref in video_refs]
        image_processor = self.processor.image_processor
        image_bounds = size_bounds(image_processor, self.image_kwargs)
        frame_bounds = size_bounds(image_processor, self.video.size_kwargs)
        visuals = [Visual(image.height, image.width, *image_bounds) for image in images]
        visuals += [
            Visual(clip.frames[0].height, clip.frames[0].width, *frame_bounds, len(clip.frames), self.video.max_frames)
            for clip in clips
        ]
        grids = self.image_grids(images, visuals[: len(images)])
        video_grids = [video_grid(image_processor, bounds_kwargs(*frame_bounds), clip) for clip in clips]
        if self.max_visual_tokens is not None:
            visuals = self.fit_budget(visuals)
            grids = self.image_grids(images, visuals[: len(images)])
            clips = [  # a video that lost frames is sampled again, as the collator will sample it
                load_clip(ref, self.video.fps, visual.max_frames) if visual.max_frames < self.video.max_frames else clip
                for ref, clip, visual in zip(video_refs, clips, visuals[len(images) :], strict=True)
            ]
            video_grids = [
                video_grid(image_processor, bounds_kwargs(visual.min_pixels, visual.max_pixels), clip)
                for clip, visual in zip(clips, visuals[len(images) :], strict=True)
            ]
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
            "image_sizes": [[visual.min_pixels, visual.max_pixels] for visual in visuals[: len(images)]],
            "video_settings": [
                {
                    "fps": self.video.fps,
                    "max_frames": visual.max_frames,
                    "min_pixels": visual.min_pixels,
                    "max_pixels": visual.max_pixels,
                }
                for visual in visuals[len(images) :]
            ],
            "length": len(input_ids),
            "num_patches": sum(t * h * w for t, h, w in grids + video_grids),
            "placeholders_added": placeholders_added > 0,
        }

    def fit_budget(self, visuals: list[Visual]) -> list[Visual]:
        """The sample's images and videos within data.max_visual_tokens (`fit_visuals`); SampleError
        `visual_tokens_over_budget` when they cannot fit."""
        image_processor = self.processor.image_processor
        factor = image_processor.patch_size * image_processor.merge_size
        fitted = fit_visuals(visuals, self.max_visual_tokens, factor, self.temporal_patch_size)
        if fitted is None:
            images = sum(not visual.frames for visual in visuals)
            raise SampleError(
                "visual_tokens_over_budget",
                f"{images} images and {len(visuals) - images} videos of "
                f"{visual_tokens(visuals, factor, self.temporal_patch_size)} visual tokens cannot fit "
                f"data.max_visual_tokens {self.max_visual_tokens} even at their smallest (one temporal patch per "
                "video, each image and frame downscaled to its limit)",
            )
        return fitted

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

    def image_grids(self, images: list, visuals: list[Visual]) -> list[list[int]]:
        """(t, h, w) patch grid per image, from the image processor's own resize rule (smart_resize, within each
        image's bounds in `visuals`) without running it; the collator checks these grids against the processor's
        output on every batch."""
        image_processor = self.processor.image_processor
        patch, merge = image_processor.patch_size, image_processor.merge_size
        grids = []
        for image, visual in zip(images, visuals, strict=True):
            try:
                height, width = visual.resized(patch * merge)
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
