"""The built-in dataset generator (data/synthetic.py) and the tiny processor (data/tiny_processor.py)."""

import json
import re

import pytest
from transformers import AutoProcessor, Qwen2_5_VLProcessor

from core.config import load_config
from core.config_tree import ConfigError
from core.data_config import KINDS, TEXT_KINDS
from core.families import hf_config
from core.special_tokens import SPECIAL_TOKENS, TINY_VOCAB_SIZE
from data.pipeline import load_processor
from data.synthetic import NUMBER_WORDS, generate_samples, write_builtin_dataset
from data.tiny_processor import load_or_build_tiny_processor


def dataset_bytes(directory):
    data_file = write_builtin_dataset(directory, num_samples=40, seed=3)
    return data_file.read_bytes(), {p.name: p.read_bytes() for p in sorted((directory / "images").iterdir())}


def test_generator_is_deterministic(tmp_path):
    """The same (num_samples, seed) writes byte-identical records and images; another seed writes other data."""
    assert dataset_bytes(tmp_path / "a") == dataset_bytes(tmp_path / "b")
    other = write_builtin_dataset(tmp_path / "c", num_samples=40, seed=4).read_bytes()
    assert other != (tmp_path / "a" / "data.jsonl").read_bytes()


def test_generator_mixes_kinds_and_sizes(tmp_path):
    """The dataset has text-only, single-image and multi-image samples, with images of several sizes, and every
    record's placeholders match its images."""
    records = [json.loads(line) for line in write_builtin_dataset(tmp_path / "d", 200, seed=0).open()]
    image_counts = {len(r["image"]) if isinstance(r.get("image"), list) else int("image" in r) for r in records}
    assert image_counts == {0, 1, 2}
    sizes = {s.size for sample in generate_samples(200, seed=0) for s in sample.scenes}
    assert len(sizes) >= 5
    for record in records:
        placeholders = sum(turn["value"].count("<image>") for turn in record["conversations"])
        images = record.get("image", [])
        assert placeholders == (len(images) if isinstance(images, list) else 1)


def test_records_carry_their_kind_and_a_kind_subset_draws_only_those(tmp_path):
    """Every built-in record names its question kind in `category`; the default mix has every default kind (and the
    text-only ones ask about no image), and data.builtin_kinds draws only the kinds it lists (unknown kinds refused)."""
    records = [json.loads(line) for line in write_builtin_dataset(tmp_path / "all", 300, seed=1).open()]
    assert {r["category"] for r in records} == set(KINDS) - {"background"}
    assert all("image" not in r and "video" not in r for r in records if r["category"] in TEXT_KINDS)
    chosen = ["background", "color"]
    assert {s.kind for s in generate_samples(50, seed=1, kinds=chosen)} == set(chosen)
    background = next(s for s in generate_samples(10, seed=2, kinds=["background"]))
    assert background.turns[-1][1] == f"The background is {background.scenes[0].background}."
    with pytest.raises(ConfigError, match="builtin_kinds"):
        load_config("recipes/smoke.yaml", ["data.builtin_kinds=[colour]"])


def test_videos_show_the_motion_they_ask_about(tmp_path):
    """Video records list 3-8 frame paths with one <video> each (some with an image too); across the frames the
    shape's centre moves the way the answer says, so the task needs the frames in order."""
    records = [json.loads(line) for line in write_builtin_dataset(tmp_path / "v", 60, seed=2, video_share=0.5).open()]
    videos = [r for r in records if "video" in r]
    assert 15 <= len(videos) <= 45 and any("image" in r for r in videos)
    for record in videos:
        assert sum(t["value"].count("<video>") for t in record["conversations"]) == 1
        assert 3 <= len(record["video"]) <= 8 and all((tmp_path / "v" / p).exists() for p in record["video"])
    for sample in generate_samples(60, seed=2, video_share=0.5):
        for frames in sample.videos:
            (x0, y0), (x1, y1) = frames[0].shapes[0].center, frames[-1].shapes[0].center
            moved = {"left to right": x1 > x0, "right to left": x1 < x0, "top to bottom": y1 > y0}
            direction = next((d for d in moved if d in sample.turns[1][1]), "bottom to top")
            assert moved.get(direction, y1 < y0)


def test_answers_are_determined_by_the_scene():
    """Counting answers name the number of shapes actually drawn, so the task is learnable from the image."""
    checked = 0
    for sample in generate_samples(300, seed=11):
        question, answer = sample.turns[0][1], sample.turns[1][1]
        if question.endswith("are in the image?"):
            count = len(sample.scenes[0].shapes)
            assert re.search(rf"\b{NUMBER_WORDS[count]}\b", answer)
            checked += 1
    assert checked > 10


def test_tiny_processor_contract(tmp_path):
    """The tiny processor reloads through AutoProcessor, keeps special tokens at ids 0..6, fits the tiny vocab,
    and its image processor matches the model's patch/merge/temporal sizes."""
    for recipe in ("tiny-qwen2_5_vl", "tiny-qwen3_vl"):
        model_config = hf_config(load_config(f"recipes/{recipe}.yaml", []).model)
        processor = load_or_build_tiny_processor(tmp_path, model_config)
        reloaded = AutoProcessor.from_pretrained(next(tmp_path.glob(f"*p{model_config.vision_config.patch_size}*")))
        for token_id, token in enumerate(SPECIAL_TOKENS):
            assert reloaded.tokenizer.convert_tokens_to_ids(token) == token_id
        assert len(processor.tokenizer) <= TINY_VOCAB_SIZE
        image_processor = reloaded.image_processor
        vision = model_config.vision_config
        assert image_processor.patch_size == vision.patch_size
        assert image_processor.merge_size == vision.spatial_merge_size
        assert image_processor.temporal_patch_size == vision.temporal_patch_size


def test_checkpoint_processor_without_torchvision_falls_back_to_image_only(tmp_path):
    """A checkpoint directory naming the family's own processor class (which needs a video processor) still loads:
    as the image-only subclass with the checkpoint's tokenizer, image processor and chat template."""
    model_config = hf_config(load_config("recipes/tiny-qwen2_5_vl.yaml", []).model)
    original = load_or_build_tiny_processor(tmp_path / "cache", model_config)
    checkpoint = tmp_path / "checkpoint"
    original.save_pretrained(checkpoint)
    config_file = checkpoint / "processor_config.json"
    config = json.loads(config_file.read_text())
    config["processor_class"] = "Qwen2_5_VLProcessor"
    config_file.write_text(json.dumps(config))
    cfg = load_config("recipes/tiny-qwen2_5_vl.yaml", [f"model.processor={checkpoint}"])
    processor = load_processor(cfg.model, cfg.data)
    assert isinstance(processor, Qwen2_5_VLProcessor)
    assert processor.chat_template == original.chat_template
    assert processor.tokenizer.get_vocab() == original.tokenizer.get_vocab()
    assert processor.image_processor.size == original.image_processor.size
