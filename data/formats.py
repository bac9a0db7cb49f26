"""Record layouts → one canonical conversation with its image and video references, and image references → PIL
images.

Canonical form: `messages` = [{"role": "system"|"user"|"assistant", "content": [{"type": "image"} |
{"type": "video"} | {"type": "text", "text": str}]}] plus `images` and `videos`, the references in placeholder
order. Image references are {"path": str | None, "bytes": bytes | None} dicts (the layout of
`datasets.Image(decode=False)`). A video reference is {"path": str | None, "bytes": bytes | None, "frames": [image
references]}: a file (path or bytes) when `frames` is empty, else the frames in time order; data/video.py decodes
and samples it.

Bad records raise `SampleError(reason, detail)`; the pipeline counts them by reason (see SKIP_REASONS).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
from PIL import Image, UnidentifiedImageError

SKIP_REASONS = (
    "unknown_format",
    "malformed_record",
    "undecodable_line",
    "missing_image",
    "corrupt_image",
    "image_count_mismatch",
    "missing_video",
    "corrupt_video",
    "empty_video",
    "video_frame_size_mismatch",
    "video_count_mismatch",
    "video_too_long",
    "visual_tokens_over_budget",
    "no_assistant_turn",
    "empty_text",
    "too_long",
)
LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# (prompt, answer) keys of one-question records: LLaMA-Factory's alpaca layout, ms-swift's query/response layout
ALPACA_KEYS = (("instruction", "output"), ("query", "response"))
PAIR_KEYS = frozenset({"human", "assistant"})  # a turn pair of ms-swift's sharegpt layout (`conversation`)
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
PLACEHOLDER_SPLIT = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")
TRANSPARENT_BACKGROUND = (255, 255, 255)  # white: what viewers and browsers show behind transparent pixels
# Keys a turn or content item may hold: anything else is a layout we do not know, so we skip rather than guess.
LLAVA_TURN_KEYS = frozenset({"from", "value"})
MESSAGE_KEYS = frozenset({"role", "content"})
CONTENT_ITEM_KEYS = frozenset({"type", "text", "image", "video", "url", "path"})
VIDEO_EXTENSIONS = frozenset(
    (".mp4", ".avi", ".mov", ".mkv", ".webm", ".flv", ".m4v", ".mpeg", ".mpg", ".wmv", ".3gp", ".ts", ".gif")
)


class DataError(ValueError):
    """The data cannot be trained on as configured (an unreadable data.path, a bad record under
    data.on_error=raise, an empty epoch); the message names the record or the setting to change."""


class SampleError(Exception):
    """A record that cannot become a training sample; `reason` is one of SKIP_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def detect_format(record: Mapping) -> str:
    """'llava' (`conversations` with from/value), 'messages' (role/content), 'pairs' (ms-swift's sharegpt:
    `conversation`, a list of {human, assistant}) or 'alpaca' (instruction/input/output, or ms-swift's
    query/response); SampleError otherwise."""
    if isinstance(record.get("conversations"), list):
        return "llava"
    if isinstance(record.get("messages"), list):
        return "messages"
    if isinstance(record.get("conversation"), list):
        return "pairs"
    if any(record.get(prompt) is not None for prompt, _ in ALPACA_KEYS):
        return "alpaca"
    raise SampleError(
        "unknown_format",
        f"no 'conversations', 'messages' or 'conversation' list, and no 'instruction' or 'query', in keys "
        f"{sorted(record)} (docs/data.md lists the record layouts)",
    )


def _malformed(where: str, value, expected: str) -> SampleError:
    return SampleError("malformed_record", f"{where} is {type(value).__name__}, not {expected}")


def _mapping(value, where: str, allowed_keys: frozenset[str]) -> Mapping:
    """`value` itself when it is a mapping whose keys are all in `allowed_keys`; SampleError otherwise. A null
    value counts as absent: arrow gives every row of a column the union of the rows' keys."""
    if not isinstance(value, Mapping):
        raise _malformed(where, value, "an object")
    unknown = sorted(str(key) for key, item in value.items() if key not in allowed_keys and item is not None)
    if unknown:
        raise SampleError("malformed_record", f"{where} has unknown keys {unknown} (known: {sorted(allowed_keys)})")
    return value


def _string(value, where: str) -> str:
    """A text field: a string, or "" for null."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _malformed(where, value, "a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # JSON's "\ud800" escapes decode to lone surrogates, which no tokenizer accepts
        raise SampleError("malformed_record", f"{where} holds an unpaired UTF-16 surrogate (not valid text)") from None
    return value


def image_ref(value) -> dict:
    """Normalise an image reference (path string, bytes, {"path","bytes"} dict, or PIL image) to {"path","bytes"}."""
    if isinstance(value, str):
        return {"path": value, "bytes": None}
    if isinstance(value, bytes | bytearray):
        return {"path": None, "bytes": bytes(value)}
    if isinstance(value, Mapping) and ("path" in value or "bytes" in value):
        path, data = value.get("path"), value.get("bytes")
        if not isinstance(path, str | None) or not isinstance(data, bytes | bytearray | None):
            raise SampleError("malformed_record", "an image reference's path must be a string and bytes bytes")
        return {"path": path, "bytes": None if data is None else bytes(data)}
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return {"path": None, "bytes": buffer.getvalue()}
    raise _malformed("an image reference", value, "a path, bytes or a {path, bytes} object")


def _record_images(record: Mapping) -> list[dict]:
    value = record.get("images", record.get("image"))
    if value is None:
        return []
    values = value if isinstance(value, list | tuple) else [value]
    return [image_ref(v) for v in values if v is not None]


def _is_video_file(value) -> bool:
    """A path (or {"path": ...}) with a video file's extension, or {"bytes": ...} that is not an image (e.g. a
    datasets Video column, which holds file bytes)."""
    path = value.get("path") if isinstance(value, Mapping) else value
    if isinstance(path, str):
        return os.path.splitext(path)[1].lower() in VIDEO_EXTENSIONS
    data = value.get("bytes") if isinstance(value, Mapping) else None
    if not isinstance(data, bytes | bytearray):
        return False
    try:
        Image.open(io.BytesIO(data)).close()  # reads the header only
    except (OSError, ValueError, Image.DecompressionBombError):
        return True
    return False


def video_ref(value) -> dict:
    """One video (a file path, file bytes, a frame list, or a {"path"|"bytes"|"frames"|"video": ...} dict) as
    {"path", "bytes", "frames"}."""
    if isinstance(value, str):
        return {"path": value, "bytes": None, "frames": []}
    if isinstance(value, bytes | bytearray):
        return {"path": None, "bytes": bytes(value), "frames": []}
    if isinstance(value, Mapping):
        if value.get("frames"):
            return video_ref(list(value["frames"]))
        if value.get("video") is not None:
            return video_ref(value["video"])
        if value.get("path") or value.get("bytes"):
            return {"path": value.get("path"), "bytes": value.get("bytes"), "frames": []}
        return {"path": None, "bytes": None, "frames": []}  # an empty frame list
    if isinstance(value, list | tuple):
        frames = []
        for frame in value:
            try:
                frames.append(image_ref(frame))
            except SampleError as error:
                raise SampleError("corrupt_video", f"frame {len(frames)}: {error.detail}") from None
        return {"path": None, "bytes": None, "frames": frames}
    raise SampleError("corrupt_video", f"unsupported video reference of type {type(value).__name__}")


def record_videos(value, placeholders: int) -> list[dict]:
    """The videos of a record's "video"/"videos" value, in order.

    A string is one file; a flat list of video-file paths is several files; a list holding lists (or frame dicts)
    is several videos; any other flat list is one video's frames. An empty list is no video, except under exactly
    one `<video>` placeholder, where it is that video's (empty) frame list.
    """
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        return [video_ref(value)]
    if not value:
        return [video_ref([])] if placeholders == 1 else []
    several = any(isinstance(v, list | tuple) or (isinstance(v, Mapping) and "frames" in v) for v in value)
    if several or all(_is_video_file(v) for v in value):
        return [video_ref(v) for v in value]
    return [video_ref(value)]


def _text_item(text: str) -> dict:
    return {"type": "text", "text": text}


def _split_placeholders(text: str) -> list[dict]:
    """'a <image> b <video>' → [text a, image, text b, video]; empty text pieces dropped."""
    items: list[dict] = []
    for piece in PLACEHOLDER_SPLIT.split(text):
        if piece == IMAGE_PLACEHOLDER:
            items.append({"type": "image"})
        elif piece == VIDEO_PLACEHOLDER:
            items.append({"type": "video"})
        elif piece.strip():
            items.append(_text_item(piece))
    return items


def _count(messages: list[dict], kind: str) -> int:
    return sum(item["type"] == kind for m in messages for item in m["content"])


def _record_videos(record: Mapping, messages: list[dict]) -> list[dict]:
    return record_videos(record.get("videos", record.get("video")), _count(messages, "video"))


def _inline_video(payload) -> list[dict]:
    return [video_ref(payload)]


# Turn roles of tool-calling conversations (LLaMA-Factory's sharegpt, ms-swift's and OpenAI's messages).
TOOL_ROLES = frozenset({"function_call", "observation", "tool", "function", "tool_call", "tool_response"})


def _unknown_role(role, known: list[str]) -> SampleError:
    if role in TOOL_ROLES:
        return SampleError(
            "unknown_format",
            f"a {role!r} turn (tool calling) is not rendered by this trainer: write tool calls and their results "
            "into user and assistant turns",
        )
    return SampleError("unknown_format", f"turn role {role!r} is not one of {known}")


def normalize_llava(record: Mapping) -> tuple[list[dict], list[dict], list[dict]]:
    messages = []
    for index, turn in enumerate(record["conversations"]):
        turn = _mapping(turn, f"turn {index}", LLAVA_TURN_KEYS)
        role = LLAVA_ROLES.get(_string(turn.get("from"), f"turn {index}'s 'from'").lower())
        if role is None:
            raise _unknown_role(turn.get("from"), sorted(LLAVA_ROLES))
        messages.append(
            {"role": role, "content": _split_placeholders(_string(turn.get("value"), f"turn {index}'s value"))}
        )
    return messages, _record_images(record), _record_videos(record, messages)


def _content_items(content, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(items, inline image references, inline video references) of a message's `content`: a string, null, or a
    list of item objects."""
    if content is None or isinstance(content, str):
        return _split_placeholders(_string(content, where)), [], []
    if not isinstance(content, list):
        raise _malformed(where, content, "a string or a list of items")
    items, images, videos = [], [], []
    for position, item in enumerate(content):
        item = _mapping(item, f"{where} item {position}", CONTENT_ITEM_KEYS)
        kind = item.get("type")
        if kind == "text" or (kind is None and "text" in item):
            text = _string(item.get("text"), f"{where} item {position}'s text")
            if text:
                items.append(_text_item(text))
        elif kind == "image" or (kind is None and item.get("image") is not None):
            items.append({"type": "image"})
            payload = next((item[k] for k in ("image", "url", "path") if item.get(k) is not None), None)
            if payload is not None:
                images.append(image_ref(payload))
        elif kind == "video" or (kind is None and item.get("video") is not None):
            items.append({"type": "video"})
            payload = next((item[k] for k in ("video", "url", "path") if item.get(k) is not None), None)
            if payload is not None:
                videos.append(video_ref(payload))
        else:
            raise SampleError("unknown_format", f"content item type {kind!r} (only text, image and video)")
    return items, images, videos


def normalize_messages(record: Mapping) -> tuple[list[dict], list[dict], list[dict]]:
    """Messages-style records: content a string or a list of items; images and videos inline in items or in
    `images` / `videos` (or `image` / `video`)."""
    messages, inline_images, inline_videos = [], [], []
    for index, message in enumerate(record["messages"]):
        message = _mapping(message, f"message {index}", MESSAGE_KEYS)
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise _unknown_role(role, ["system", "user", "assistant"])
        items, images, videos = _content_items(message.get("content"), f"message {index}'s content")
        inline_images += images
        inline_videos += videos
        messages.append({"role": role, "content": items})
    return messages, inline_images or _record_images(record), inline_videos or _record_videos(record, messages)


def _history_turns(history, where: str) -> list[dict]:
    """User and assistant messages of an alpaca-style `history`: a list of [prompt, answer] pairs, oldest first."""
    if history is None:
        return []
    if not isinstance(history, list):
        raise _malformed(where, history, "a list of [prompt, answer] pairs")
    messages = []
    for index, pair in enumerate(history):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise _malformed(f"{where} item {index}", pair, "a [prompt, answer] pair")
        messages.append({"role": "user", "content": _split_placeholders(_string(pair[0], f"{where} item {index}"))})
        messages.append(
            {"role": "assistant", "content": _split_placeholders(_string(pair[1], f"{where} item {index}"))}
        )
    return messages


def normalize_alpaca(record: Mapping) -> tuple[list[dict], list[dict], list[dict]]:
    """One-question records as their frameworks read them: LLaMA-Factory's alpaca layout (`instruction`, then
    `input` on the next line when set, answered by `output`) or ms-swift's (`query` answered by `response`); both
    after the turns of `history` ([prompt, answer] pairs)."""
    prompt_key, answer_key = next(keys for keys in ALPACA_KEYS if record.get(keys[0]) is not None)
    answer = record.get(answer_key)
    if isinstance(answer, list):  # LLaMA-Factory's ranking data: [chosen, rejected]
        raise SampleError(
            "unknown_format",
            f"'{answer_key}' is a list (preference data): keep the preferred answer as a string in '{answer_key}'",
        )
    parts = [_string(record.get(prompt_key), f"'{prompt_key}'")]
    if prompt_key == "instruction":
        parts.append(_string(record.get("input"), "'input'"))
    messages = _history_turns(record.get("history"), "'history'")
    messages.append({"role": "user", "content": _split_placeholders("\n".join(part for part in parts if part))})
    messages.append({"role": "assistant", "content": _split_placeholders(_string(answer, f"'{answer_key}'"))})
    return messages, _record_images(record), _record_videos(record, messages)


def normalize_pairs(record: Mapping) -> tuple[list[dict], list[dict], list[dict]]:
    """ms-swift's sharegpt layout: `conversation`, a list of {"human": prompt, "assistant": answer} turn pairs."""
    messages = []
    for index, pair in enumerate(record["conversation"]):
        pair = _mapping(pair, f"conversation pair {index}", PAIR_KEYS)
        for key, role in (("human", "user"), ("assistant", "assistant")):
            text = _string(pair.get(key), f"conversation pair {index}'s {key!r}")
            messages.append({"role": role, "content": _split_placeholders(text)})
    return messages, _record_images(record), _record_videos(record, messages)


# Record keys of training kinds other than supervised fine-tuning, and what to change to train on the record here.
UNSUPPORTED_KEYS = {
    "chosen": "preference pairs (LLaMA-Factory's chosen/rejected) train a DPO-style objective: keep the chosen answer "
    "as the assistant turn and drop 'chosen'/'rejected'",
    "rejected_response": "preference data (ms-swift's rejected_response) trains a DPO-style objective: drop "
    "'rejected_response' to train on the assistant turn",
    "kto_tag": "KTO data (LLaMA-Factory's kto_tag): keep the records tagged true and drop 'kto_tag'",
    "tools": "tool-calling records ('tools') are not rendered by this trainer: drop 'tools' and write the calls and "
    "their results into the turns' text",
    "objects": "grounding records (ms-swift's 'objects', <ref-object>/<bbox>) are not expanded here: write each "
    "object's name and box into the text and drop 'objects'",
    "audios": "Qwen-VL models take no audio: drop the record's 'audios' (and its <audio> placeholders)",
}


def refuse_unsupported(record: Mapping) -> None:
    """SampleError (unknown_format) naming what to change when the record carries a training kind this trainer does
    not train (UNSUPPORTED_KEYS); empty values count as absent, as arrow gives every row each column (and
    LLaMA-Factory writes no tools as the JSON string "[]")."""
    for key, change in UNSUPPORTED_KEYS.items():
        if record.get(key) not in (None, "", "[]", [], {}):
            raise SampleError("unknown_format", change)


def with_system(record: Mapping, messages: list[dict]) -> list[dict]:
    """The messages behind the record's top-level `system` prompt (LLaMA-Factory's and ms-swift's `system` key),
    when it has one; a record with both that key and a system turn is refused (which one counts is a guess)."""
    system = _string(record.get("system"), "'system'")
    if not system:
        return messages
    if any(message["role"] == "system" for message in messages):
        raise SampleError("malformed_record", "both a 'system' key and a system turn: keep one of them")
    return [{"role": "system", "content": [_text_item(system)]}, *messages]


def _role_content_turns(turns: list) -> bool:
    """`conversations` written with role/content turns (LLaMA-Factory's sharegpt tags set so), not from/value."""
    return bool(turns) and isinstance(turns[0], Mapping) and "role" in turns[0] and "from" not in turns[0]


def retype_llava_video_placeholders(messages: list[dict], images: list, videos: list) -> None:
    """LLaVA-OneVision / LLaVA-Video records mark a video with `<image>` (their model takes its frames as images): a
    record with videos, no image and no `<video>`, and one `<image>` per video, has its `<image>` placeholders read
    as the videos'."""
    if images or not videos or _count(messages, "video") or _count(messages, "image") != len(videos):
        return
    for message in messages:
        message["content"] = [{"type": "video"} if item["type"] == "image" else item for item in message["content"]]


def add_missing_placeholders(messages: list[dict], images: list, videos: list) -> int:
    """As LLaMA-Factory's chat engine does: a record with images but no image placeholder anywhere gets one per
    image in front of its first user turn, and likewise videos (the videos' in front of the images'). Returns the
    placeholders added (0 when the record has them, or some of them: a partial set stays a counted mismatch)."""
    first_user = next((message for message in messages if message["role"] == "user"), None)
    if first_user is None:
        return 0
    added = []
    for kind, refs in (("image", images), ("video", videos)):
        if refs and not _count(messages, kind):
            added = [{"type": kind} for _ in refs] + added
    first_user["content"] = added + first_user["content"]
    return len(added)


class NormalizedRecord(NamedTuple):
    """A record in canonical form (module docstring) and how many placeholders `add_missing_placeholders` added."""

    messages: list[dict]
    images: list[dict]
    videos: list[dict]
    placeholders_added: int


def normalize_record(record: Mapping, data_format: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(messages, images, videos) of a record (`normalized_record`)."""
    messages, images, videos, _ = normalized_record(record, data_format)
    return messages, images, videos


def normalized_record(record: Mapping, data_format: str) -> NormalizedRecord:
    """A record's messages, images and videos; checks placeholders match images and videos and there is an
    assistant turn with text.

    `data_format`: 'auto', 'llava', 'messages', 'pairs' or 'alpaca'.
    """
    refuse_unsupported(record)
    layout = detect_format(record) if data_format == "auto" else data_format
    if layout == "llava" and "conversations" in record and _role_content_turns(record["conversations"]):
        messages, images, videos = normalize_messages({**record, "messages": record["conversations"]})
    elif layout == "llava" and "conversations" in record:
        messages, images, videos = normalize_llava(record)
        retype_llava_video_placeholders(messages, images, videos)
    elif layout == "messages" and "messages" in record:
        messages, images, videos = normalize_messages(record)
    elif layout == "pairs" and "conversation" in record:
        messages, images, videos = normalize_pairs(record)
    elif layout == "alpaca" and any(record.get(prompt) is not None for prompt, _ in ALPACA_KEYS):
        messages, images, videos = normalize_alpaca(record)
    else:
        raise SampleError("unknown_format", f"record is not in {layout!r} format (keys {sorted(record)})")
    messages = with_system(record, messages)
    added = add_missing_placeholders(messages, images, videos)
    placeholders = _count(messages, "image")
    if placeholders != len(images):
        raise SampleError("image_count_mismatch", f"{placeholders} image placeholders but {len(images)} images")
    if _count(messages, "video") != len(videos):
        raise SampleError(
            "video_count_mismatch", f"{_count(messages, 'video')} video placeholders, {len(videos)} videos"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise SampleError("no_assistant_turn", "the conversation has no assistant turn to learn from")
    for index, message in enumerate(messages):
        if not message["content"]:
            raise SampleError("empty_text", f"turn {index} ({message['role']}) is empty")
    if not any(item["type"] == "text" for m in messages if m["role"] == "assistant" for item in m["content"]):
        raise SampleError("empty_text", "no assistant turn has text")
    return NormalizedRecord(messages, images, videos, added)


def resolve_ref(ref: Mapping, image_root: str | None) -> dict:
    """The same reference with a relative path made absolute against `image_root`."""
    path = ref.get("path")
    if ref.get("bytes") is None and path and image_root and not os.path.isabs(path):
        path = os.path.join(image_root, path)
    return {"path": path, "bytes": ref.get("bytes")}


def resolve_video(ref: Mapping, root: str | None) -> dict:
    """The same reference with relative file and frame paths made absolute against `root` (data.image_root)."""
    resolved = resolve_ref(ref, root)
    return {**resolved, "frames": [resolve_ref(frame, root) for frame in ref.get("frames") or []]}


def _scaled_to_8_bit(image: Image.Image) -> Image.Image:
    """An "I;16*", "I" or "F" image as "L", scaled by the range its values really use: Pillow's own convert clips
    them at 255 (a 16-bit scan turns almost all white). 16-bit modes: 0..65535. "I": 0..255 as is, 0..65535 as
    16-bit, anything else min..max. "F": 0..1 as unit floats, 0..255 as is, anything else min..max (NaN as 0)."""
    values = np.nan_to_num(np.asarray(image, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    low, high = float(values.min()), float(values.max())
    if image.mode.startswith("I;16"):
        low, high = 0.0, 65535.0
    elif image.mode == "F" and low >= 0 and high <= 1:
        low, high = 0.0, 1.0
    elif low >= 0 and high <= 255:
        low, high = 0.0, 255.0
    elif image.mode == "I" and low >= 0 and high <= 65535:
        low, high = 0.0, 65535.0
    scaled = (values - low) * (255.0 / (high - low)) if high > low else np.clip(values, 0, 255)
    return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), mode="L")


def to_rgb(image: Image.Image) -> Image.Image:
    """The image as 8-bit RGB, whatever its Pillow mode: high-bit-depth gray scaled by its range
    (`_scaled_to_8_bit`), anything with transparency (RGBA, LA, La, PA, P/L/RGB with a transparent colour)
    composited on TRANSPARENT_BACKGROUND, everything else (1, L, P, CMYK, YCbCr, HSV, ...) through Pillow's
    conversion."""
    if image.mode in ("I", "F") or image.mode.startswith("I;16"):
        return _scaled_to_8_bit(image).convert("RGB")
    if image.mode == "La":  # premultiplied: Pillow converts it to LA only
        image = image.convert("LA")
    if image.mode in ("RGBA", "RGBa", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*TRANSPARENT_BACKGROUND, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(ref: Mapping) -> Image.Image:
    """Decode a resolved reference to an RGB PIL image. SampleError: missing_image / corrupt_image."""
    source = ref.get("bytes")
    if source is None:
        path = ref.get("path")
        if not path:
            raise SampleError("missing_image", "image reference has neither bytes nor a path")
        try:
            with open(path, "rb") as handle:
                source = handle.read()
        except OSError as error:
            raise SampleError("missing_image", f"{path}: {error.strerror or error}") from None
        except ValueError as error:  # a NUL byte or a lone surrogate: no file can have that name
            raise SampleError("missing_image", f"{path!r} is not a valid file name ({error})") from None
    try:
        with Image.open(io.BytesIO(source)) as image:
            return to_rgb(image)
    except UnidentifiedImageError:
        raise SampleError("corrupt_image", f"{ref.get('path') or '<bytes>'}: not a recognised image format") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:  # truncated, damaged, huge
        raise SampleError("corrupt_image", f"{ref.get('path') or '<bytes>'}: {error}") from None
