"""Record layouts → one canonical conversation, and image references → PIL images.

Canonical form: `messages` = [{"role": "system"|"user"|"assistant", "content": [{"type": "image"} |
{"type": "video"} | {"type": "text", "text": str}]}] plus `images` and `videos`, the references in placeholder
order. Image references are {"path": str | None, "bytes": bytes | None} dicts (the layout of
`datasets.Image(decode=False)`); video references are data/video.py's.

Bad records raise `SampleError(reason, detail)`; the pipeline counts them by reason (see SKIP_REASONS).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Mapping

from PIL import Image, UnidentifiedImageError

SKIP_REASONS = (
    "unknown_format",
    "missing_image",
    "corrupt_image",
    "image_count_mismatch",
    "missing_video",
    "corrupt_video",
    "empty_video",
    "video_frame_size_mismatch",
    "video_count_mismatch",
    "video_too_long",
    "no_assistant_turn",
    "empty_text",
    "too_long",
)
LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
PLACEHOLDER_SPLIT = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


class SampleError(Exception):
    """A record that cannot become a training sample; `reason` is one of SKIP_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def detect_format(record: Mapping) -> str:
    """'llava' (`conversations` with from/value) or 'messages' (role/content); SampleError otherwise."""
    if isinstance(record.get("conversations"), list):
        return "llava"
    if isinstance(record.get("messages"), list):
        return "messages"
    raise SampleError("unknown_format", f"no 'conversations' or 'messages' list in keys {sorted(record)}")


def image_ref(value) -> dict:
    """Normalise an image reference (path string, bytes, {"path","bytes"} dict, or PIL image) to {"path","bytes"}."""
    if isinstance(value, str):
        return {"path": value, "bytes": None}
    if isinstance(value, bytes | bytearray):
        return {"path": None, "bytes": bytes(value)}
    if isinstance(value, Mapping) and ("path" in value or "bytes" in value):
        return {"path": value.get("path"), "bytes": value.get("bytes")}
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return {"path": None, "bytes": buffer.getvalue()}
    raise SampleError("missing_image", f"unsupported image reference of type {type(value).__name__}")


def _record_images(record: Mapping) -> list[dict]:
    value = record.get("images", record.get("image"))
    if value is None:
        return []
    values = value if isinstance(value, list | tuple) else [value]
    return [image_ref(v) for v in values if v is not None]


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
    from data.video import record_videos  # imported here: data.video builds on this module (a cycle at import)

    return record_videos(record.get("videos", record.get("video")), _count(messages, "video"))


def _inline_video(payload) -> list[dict]:
    from data.video import video_ref

    return [video_ref(payload)]


def normalize_llava(record: Mapping) -> tuple[list[dict], list[dict], list[dict]]:
    messages = []
    for turn in record["conversations"]:
        role = LLAVA_ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise SampleError("unknown_format", f"turn role {turn.get('from')!r} is not one of {sorted(LLAVA_ROLES)}")
        messages.append({"role": role, "content": _split_placeholders(str(turn.get("value") or ""))})
    return messages, _record_images(record), _record_videos(record, messages)


def normalize_messages(record: Mapping) -> tuple[list[dict], list[dict], list[dict]]:
    """Messages-style records: content a string or a list of items; images and videos inline in items or in
    `images` / `videos` (or `image` / `video`)."""
    messages, inline_images, inline_videos = [], [], []
    for message in record["messages"]:
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise SampleError("unknown_format", f"message role {role!r} is not system/user/assistant")
        content = message.get("content")
        if isinstance(content, str):
            items = _split_placeholders(content)
        else:
            items = []
            for item in content or []:
                kind = item.get("type")
                if kind == "text" and item.get("text"):
                    items.append(_text_item(item["text"]))
                elif kind == "image" or (kind is None and item.get("image") is not None):
                    items.append({"type": "image"})
                    payload = item.get("image") or item.get("url") or item.get("path")
                    if payload is not None:
                        inline_images.append(image_ref(payload))
                elif kind == "video" or (kind is None and item.get("video") is not None):
                    items.append({"type": "video"})
                    payload = next((item[k] for k in ("video", "url", "path") if item.get(k) is not None), None)
                    if payload is not None:
                        inline_videos += _inline_video(payload)
                elif kind not in ("text", "image", "video"):
                    raise SampleError("unknown_format", f"content item type {kind!r} (only text, image and video)")
        messages.append({"role": role, "content": items})
    return messages, inline_images or _record_images(record), inline_videos or _record_videos(record, messages)


def normalize_record(record: Mapping, data_format: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(messages, images, videos) of a record; checks placeholders match images and videos and there is an
    assistant turn with text.

    `data_format`: 'auto', 'llava' or 'messages'.
    """
    layout = detect_format(record) if data_format == "auto" else data_format
    if layout == "llava" and "conversations" in record:
        messages, images, videos = normalize_llava(record)
    elif layout == "messages" and "messages" in record:
        messages, images, videos = normalize_messages(record)
    else:
        raise SampleError("unknown_format", f"record is not in {layout!r} format (keys {sorted(record)})")
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
    return messages, images, videos


def resolve_ref(ref: Mapping, image_root: str | None) -> dict:
    """The same reference with a relative path made absolute against `image_root`."""
    path = ref.get("path")
    if ref.get("bytes") is None and path and image_root and not os.path.isabs(path):
        path = os.path.join(image_root, path)
    return {"path": path, "bytes": ref.get("bytes")}


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
    try:
        with Image.open(io.BytesIO(source)) as image:
            return image.convert("RGB")
    except UnidentifiedImageError:
        raise SampleError("corrupt_image", f"{ref.get('path') or '<bytes>'}: not a recognised image format") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:  # truncated, damaged, huge
        raise SampleError("corrupt_image", f"{ref.get('path') or '<bytes>'}: {error}") from None
