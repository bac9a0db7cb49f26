"""Records from other frameworks (LLaMA-Factory, ms-swift, LLaVA) read as those frameworks read them
(data/formats.py), or refused in one line that says what to change; docs/data.md's examples of each."""

import json
import logging
import re
import sys
from pathlib import Path

import pytest
from PIL import Image

from core.config import load_config
from core.families import hf_config
from data.formats import SampleError, normalized_record
from data.pipeline import build_data, load_processor
from data.synthetic import write_builtin_dataset

ROOT = Path(__file__).resolve().parents[1]


def text(content: str) -> dict:
    return {"type": "text", "text": content}


def test_media_without_placeholders_get_one_each_in_front_of_the_first_user_turn():
    """A record with images and videos and no placeholder gets one per image and video in front of its first user
    turn, the videos' in front of the images' (LLaMA-Factory's chat engine prepends the images', then the
    videos'), after the system turn; the count of placeholders added is returned."""
    record = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Same colour?"},
            {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "Yes."},
        ],
        "images": ["a.png", "b.png"],
        "videos": ["v.mp4"],
    }
    messages, images, videos, added = normalized_record(record, "auto")
    assert added == 3 and len(images) == 2 and len(videos) == 1
    assert messages[1]["content"] == [{"type": "video"}, {"type": "image"}, {"type": "image"}, text("Same colour?")]
    assert messages[0]["content"] == [text("Be brief.")] and messages[3]["content"] == [text("Sure?")]


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"conversations": [{"from": "human", "value": "<image> a"}, {"from": "gpt", "value": "b"}]}, "image"),
        ({"messages": [{"role": "user", "content": "<video> a"}, {"role": "assistant", "content": "b"}]}, "video"),
    ],
)
def test_some_placeholders_but_not_all_stay_a_counted_mismatch(record, reason):
    """One placeholder for two images (or videos) is a mismatch, not a guess at where the second goes."""
    with pytest.raises(SampleError) as error:
        normalized_record(
            {**record, f"{reason}s": ["x.png", "y.png"] if reason == "image" else ["x.mp4", "y.mp4"]}, "auto"
        )
    assert error.value.reason == f"{reason}_count_mismatch"


def test_empty_values_of_the_refused_keys_are_absent():
    """A column every row has (arrow's union of keys) left empty, or LLaMA-Factory's "[]" for no tools, refuses
    nothing."""
    record = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}], "tools": "[]"}
    assert normalized_record({**record, "chosen": None, "objects": [], "audios": []}, "auto").messages[1]["role"] == (
        "assistant"
    )


def test_a_record_with_its_placeholders_is_unchanged():
    """Placeholders already there are kept where they are and none is added."""
    record = {"messages": [{"role": "user", "content": "a <image> b"}, {"role": "assistant", "content": "c"}]}
    messages, _, _, added = normalized_record({**record, "images": ["x.png"]}, "auto")
    assert added == 0 and messages[0]["content"] == [text("a "), {"type": "image"}, text(" b")]


@pytest.mark.parametrize(
    ("record", "layout", "expected"),
    [
        (  # LLaMA-Factory alpaca: history first, then instruction + "\n" + input, answered by output
            {
                "instruction": "<image>Describe it.",
                "input": "In one word.",
                "output": "Cat.",
                "system": "Be brief.",
                "history": [["Hi.", "Hello."]],
                "images": ["cat.png"],
            },
            "alpaca",
            [
                ("system", [text("Be brief.")]),
                ("user", [text("Hi.")]),
                ("assistant", [text("Hello.")]),
                ("user", [{"type": "image"}, text("Describe it.\nIn one word.")]),
                ("assistant", [text("Cat.")]),
            ],
        ),
        (  # ms-swift query/response
            {"query": "<image>What is it?", "response": "A cat.", "history": [], "images": ["cat.png"]},
            "alpaca",
            [("user", [{"type": "image"}, text("What is it?")]), ("assistant", [text("A cat.")])],
        ),
        (  # ms-swift sharegpt: conversation of {human, assistant} pairs, a top-level system
            {
                "system": "Be brief.",
                "conversation": [
                    {"human": "<image>What?", "assistant": "A cat."},
                    {"human": "Colour?", "assistant": "Red."},
                ],
                "images": ["cat.png"],
            },
            "pairs",
            [
                ("system", [text("Be brief.")]),
                ("user", [{"type": "image"}, text("What?")]),
                ("assistant", [text("A cat.")]),
                ("user", [text("Colour?")]),
                ("assistant", [text("Red.")]),
            ],
        ),
        (  # LLaVA-Video / OneVision: a video marked by <image>
            {
                "video": "clips/dog.mp4",
                "conversations": [
                    {"from": "human", "value": "<image>\nWhat happens?"},
                    {"from": "gpt", "value": "A run."},
                ],
            },
            "llava",
            [("user", [{"type": "video"}, text("\nWhat happens?")]), ("assistant", [text("A run.")])],
        ),
        (  # LLaMA-Factory sharegpt with role/content tags
            {
                "conversations": [
                    {"role": "user", "content": "<image>What?"},
                    {"role": "assistant", "content": "A cat."},
                ],
                "images": ["cat.png"],
            },
            "llava",
            [("user", [{"type": "image"}, text("What?")]), ("assistant", [text("A cat.")])],
        ),
        (  # LLaMA-Factory sharegpt: LLaVA's layout plus a top-level system
            {
                "system": "Be brief.",
                "conversations": [{"from": "human", "value": "<image>What?"}, {"from": "gpt", "value": "A cat."}],
                "images": ["cat.png"],
            },
            "llava",
            [
                ("system", [text("Be brief.")]),
                ("user", [{"type": "image"}, text("What?")]),
                ("assistant", [text("A cat.")]),
            ],
        ),
    ],
)
def test_peer_layouts_read_as_their_frameworks_read_them(record, layout, expected):
    """Each layout gives the conversation its framework builds (detected, and named in data.format alike); a
    LLaVA-Video record's `<image>` beside a video and no image is that video's placeholder."""
    for data_format in ("auto", layout):
        messages, images, videos, _ = normalized_record(record, data_format)
        assert [(m["role"], m["content"]) for m in messages] == expected
        assert len(images) + len(videos) == 1


CONVERSATION = [{"from": "human", "value": "<image>What?"}, {"from": "gpt", "value": "A cat."}]


@pytest.mark.parametrize(
    ("record", "change"),
    [
        ({"conversations": CONVERSATION, "chosen": {"from": "gpt", "value": "x"}, "rejected": {}}, "keep the chosen"),
        ({"messages": [{"role": "user", "content": "q"}], "rejected_response": "no"}, "drop 'rejected_response'"),
        ({"instruction": "q", "output": ["good", "bad"]}, "keep the preferred answer as a string"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "kto_tag": True},
            "kto",
        ),
        ({"conversations": CONVERSATION, "tools": '[{"name": "f"}]'}, "drop 'tools'"),
        ({"conversations": [CONVERSATION[0], {"from": "function_call", "value": "{}"}]}, "tool calls"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}]}, "tool calls"),
        ({"conversations": CONVERSATION, "objects": {"ref": ["cat"], "bbox": [[0, 0, 1, 1]]}}, "drop 'objects'"),
        ({"messages": [{"role": "user", "content": "<audio>q"}], "audios": ["a.wav"]}, "drop the record's 'audios'"),
        (
            {"conversations": CONVERSATION, "system": "s", "images": ["x"]}
            | {"conversations": [{"from": "system", "value": "t"}, *CONVERSATION]},
            "keep one of them",
        ),
        ({"question": "q", "answer": "a"}, "docs/data.md lists the record layouts"),
    ],
)
def test_other_shapes_are_refused_in_one_line_that_says_what_to_change(record, change):
    """Preference, KTO, tool-calling, grounding and audio records, two system prompts and unknown layouts are
    skips whose one-line detail names what to change."""
    with pytest.raises(SampleError) as error:
        normalized_record(record, "auto")
    assert change.lower() in error.value.detail.lower() and "\n" not in str(error.value)


def test_a_dataset_without_placeholders_trains_and_is_said_once(tmp_path, caplog):
    """Records with images and videos but no placeholder (older LLaMA-Factory demo sets) are all kept, as the same
    records with LLaMA-Factory's placeholders written in front of the first user turn (identical tokens); one log
    line says how many records got them."""
    source = write_builtin_dataset(tmp_path / "src", 12, seed=5)
    plain, explicit = [], []
    for line in source.read_text().splitlines():
        record = json.loads(line)
        images = record.pop("image", [])
        images = [images] if isinstance(images, str) else images
        videos = [record.pop("video")] if "video" in record else []
        turns = record.pop("conversations")
        first = re.sub(r"<(image|video)>\n", "", turns[0]["value"])
        messages = [{"role": "user", "content": first}, {"role": "assistant", "content": turns[1]["value"]}]
        media = {"images": [str(source.parent / p) for p in images]}
        media["videos"] = [[str(source.parent / p) for p in frames] for frames in videos]
        plain.append({**record, "messages": messages, **media})
        prefix = "<video>" * len(videos) + "<image>" * len(images)
        explicit.append({**record, "messages": [{**messages[0], "content": prefix + first}, messages[1]], **media})
    tokens = {}
    for name, records in (("plain", plain), ("explicit", explicit)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        cfg = load_config(
            "recipes/tiny-qwen2_5_vl.yaml",
            [f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}", "data.num_workers=0", "data.eval_fraction=0"],
        )
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="data.pipeline"):
            train, _, stats = build_data(
                cfg.data, cfg.packing, load_processor(cfg.model, cfg.data), hf_config(cfg.model)
            )
        notes = [r.getMessage() for r in caplog.records if "no <image> / <video> placeholder" in r.getMessage()]
        with_media = sum(bool(r["images"] or r["videos"]) for r in records)
        assert stats.kept_train == len(records) and not stats.skipped
        assert notes == (
            [
                f"data: {with_media} records have images or videos but no <image> / <video> placeholder; "
                "each got one per image and video in front of its first user turn, as LLaMA-Factory does"
            ]
            if name == "plain"
            else []
        )
        keys = [item.key for step in train.steps(0) for pack in step for item in pack.items]
        tokens[name] = sorted(tuple(row["input_ids"]) for row in train.fetch(keys))
    assert with_media > 0 and tokens["plain"] == tokens["explicit"]


def _section(markdown: str, title: str) -> str:
    start = markdown.index(f"## {title}")
    end = markdown.find("\n## ", start + 1)
    return markdown[start : end if end > 0 else None]


def test_the_docs_examples_from_other_frameworks_are_read():
    """docs/data.md's "Coming from another framework": every JSON record in it is read (a sample with an assistant
    turn, one placeholder per image and video), and each framework named has an example."""
    section = _section((ROOT / "docs" / "data.md").read_text(), "Coming from another framework")
    blocks = re.findall(r"```json\n(.*?)```", section, flags=re.S)
    records = [json.loads(line) for block in blocks for line in block.splitlines() if line.strip()]
    assert len(records) >= 4 and all(name in section for name in ("LLaMA-Factory", "ms-swift", "LLaVA"))
    for record in records:
        messages, images, videos, _ = normalized_record(record, "auto")
        counts = [sum(item["type"] == kind for m in messages for item in m["content"]) for kind in ("image", "video")]
        assert counts == [len(images), len(videos)] and any(m["role"] == "assistant" for m in messages)


def test_inspect_data_says_how_many_records_got_placeholders(tmp_path, monkeypatch, capsys):
    """`scripts.inspect_data` prints the placeholder note beside its sample counts."""
    from scripts import inspect_data

    image = tmp_path / "red.png"
    Image.new("RGB", (56, 56), "red").save(image)
    turns = [{"role": "user", "content": "What colour?"}, {"role": "assistant", "content": "Red."}]
    records = [{"messages": turns, "images": [str(image)]}] * 3 + [{"messages": turns}]
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["inspect_data", "--config", "recipes/tiny-qwen2_5_vl.yaml", f"data.path={tmp_path / 'plain.jsonl'}"]
    monkeypatch.setattr(sys, "argv", [*argv, f"data.cache_dir={tmp_path / 'cache'}", "data.eval_fraction=0"])
    inspect_data.main()
    assert "3 records have images or videos but no <image> / <video> placeholder" in capsys.readouterr().out
