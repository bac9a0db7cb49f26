"""Eval records → prompts built exactly as training builds its samples, and their references.

A record in any layout training reads (LLaVA / ShareGPT, messages; images, videos, several of each, multi-turn) is
normalised by data/formats.py; its prompt is the conversation up to its last assistant turn and its reference is
that turn's text (or the record's `answers` list when it has one, as DocVQA-style data does). The prompt's token ids,
image grids and video grids come from data/processing.py's `SampleProcessor` run on the conversation through that
turn: the ids before the turn's first label are the prompt the model saw in training, to the token, with the run's
pixel and frame settings.

Bad records: an image or video that is missing or corrupt (and any other reason training would skip the record for)
is an `EvalPrompt` with `skip_reason` set, counted and written to the predictions with its reason; a record without a
non-empty reference raises `EvalDataError` naming it; a prompt that leaves no room in the model's context for one
new token is skipped as `too_long` (never truncated: a cut could fall inside an image's tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from data.formats import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, DataError, SampleError, normalize_record
from data.processing import IGNORE_INDEX, RECORD_LOCATION_COLUMN, SampleProcessor, parse_record

REFERENCE_REASONS = frozenset({"no_assistant_turn", "empty_text"})  # SampleErrors that mean: no usable reference


class EvalDataError(DataError):
    """An eval record that cannot be scored as given (no reference); the message names the record."""


@dataclass
class EvalPrompt:
    """One record's prompt: `row` holds the processed prompt (data/processing.py's columns, cut before the reference:
    input_ids, image and video references and grids) or None when the record is skipped."""

    index: int  # the record's position in the data (0-based)
    sample_id: str
    location: str  # "line 7" / "item 7" / "row 7"
    category: str | None
    references: list[str]
    prompt_text: str  # the conversation before the reference, with <image> / <video> placeholders
    row: dict | None = None
    skip_reason: str = ""
    skip_detail: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.row["input_ids"]) if self.row is not None else 0


def conversation_text(messages: list[dict]) -> str:
    """The turns as "role: text" lines, placeholders where the images and videos are."""
    lines = []
    for message in messages:
        pieces = []
        for item in message["content"]:
            if item["type"] == "image":
                pieces.append(IMAGE_PLACEHOLDER)
            elif item["type"] == "video":
                pieces.append(VIDEO_PLACEHOLDER)
            else:
                pieces.append(item["text"])
        lines.append(f"{message['role']}: {' '.join(pieces)}")
    return "\n".join(lines)


def _reply_text(message: dict) -> str:
    return "".join(item["text"] for item in message["content"] if item["type"] == "text").strip()


def _references(record: Mapping, reply: str) -> list[str]:
    answers = record.get("answers")
    if isinstance(answers, list) and answers and all(isinstance(a, str) for a in answers):
        return [a for a in answers if a.strip()] or [reply]
    return [reply]


def prompt_start(labels: list[int]) -> int:
    """Index of the first label of the last labelled run: where the last assistant reply begins."""
    end = len(labels)
    while end > 0 and labels[end - 1] == IGNORE_INDEX:
        end -= 1
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start


class PromptBuilder:
    """`build(raw_record, index) -> EvalPrompt`.

    `sample_processor`: a training `SampleProcessor` with the run's processor, model config, image root, pixel bounds
    and video settings, and data_format "messages" (it processes the canonical conversation); `data_format`: the
    records' layout ("auto", "llava", "messages"); `max_positions`: the model's context length (None: unbounded)."""

    def __init__(self, sample_processor: SampleProcessor, data_format: str, max_positions: int | None):
        if sample_processor.data_format != "messages":
            raise ValueError("PromptBuilder's SampleProcessor takes canonical conversations: data_format='messages'")
        self.sample_processor = sample_processor
        self.data_format = data_format
        self.max_positions = max_positions

    def build(self, raw: Mapping, index: int) -> EvalPrompt:
        location = raw.get(RECORD_LOCATION_COLUMN) or f"row {index + 1}"
        prompt = EvalPrompt(index, location, location, None, [], "")
        try:
            record = parse_record(raw)
            prompt.sample_id = str(record.get("id", location))
            category = record.get("category")
            prompt.category = None if category is None else str(category)
            self._fill(prompt, record)
        except SampleError as error:
            if error.reason in REFERENCE_REASONS:
                raise EvalDataError(
                    f"record {prompt.sample_id} ({location}): {error.detail}: an eval record needs a non-empty "
                    "reference, its last assistant turn"
                ) from None
            prompt.row, prompt.skip_reason, prompt.skip_detail = None, error.reason, error.detail
        return prompt

    def _fill(self, prompt: EvalPrompt, record: Mapping) -> None:
        messages, images, videos = normalize_record(record, self.data_format)
        last = max(i for i, message in enumerate(messages) if message["role"] == "assistant")
        reply = _reply_text(messages[last])
        if not reply:
            raise SampleError("empty_text", f"turn {last} (the reference) has no text")
        prompt.references = _references(record, reply)
        prompt.prompt_text = conversation_text(messages[:last])
        prompt.row = self._prompt_row(messages[: last + 1], images, videos, prompt.sample_id)

    def conversation(self, messages: list[dict], images: list[dict], videos: list[dict]) -> EvalPrompt:
        """The prompt that asks for the next assistant turn of a canonical conversation (data/formats.py's form,
        ending with a user turn), e.g. a chat; SampleError when an image or video cannot be used."""
        placeholder = {"role": "assistant", "content": [{"type": "text", "text": "..."}]}
        prompt = EvalPrompt(0, "chat", "chat", None, [], conversation_text(messages))
        prompt.row = self._prompt_row([*messages, placeholder], images, videos, "chat")
        return prompt

    def _prompt_row(self, messages: list[dict], images: list[dict], videos: list[dict], sample_id: str) -> dict:
        """The processed row of `messages` (ending with the assistant turn to generate) cut before that turn."""
        counts = {kind: sum(i["type"] == kind for m in messages for i in m["content"]) for kind in ("image", "video")}
        canonical = {"messages": messages, "images": images[: counts["image"]], "videos": videos[: counts["video"]]}
        row = self.sample_processor.process(canonical, sample_id)
        start = prompt_start(row["labels"])
        if self.max_positions is not None and start >= self.max_positions:
            raise SampleError("too_long", f"{start} prompt tokens leave no room in the model's {self.max_positions}")
        row["input_ids"] = row["input_ids"][:start]
        row["labels"] = [IGNORE_INDEX] * start
        row["mrope_positions"] = [axis[:start] for axis in row["mrope_positions"]]
        row["length"] = start
        return row
