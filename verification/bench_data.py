"""Datasets the measurements write from the built-in generator (data/synthetic.py), in LLaVA/ShareGPT form:

`write_llava_records`: a large JSONL over a small pool of images, for the pipeline at scale
(scripts/make_llava_records.py, scripts/measure_data_scale.py; docs/data-scale.md).
`write_long_samples`: samples of one image and about N words each, for the longest sample that trains
(scripts/make_long_samples.py; context parallelism).

Both are deterministic: same arguments, same files.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

from data.synthetic import corpus_texts, draw_scene, generate_samples

IMAGES_PER_RECORD = (0, 1, 2)
IMAGES_PER_RECORD_WEIGHTS = (15, 70, 15)
MAX_TURNS = 4
ANSWER_WORDS = (2, 240)  # drawn log-uniformly: many short answers, a long tail
QUESTION_WORDS = (3, 16)


def pool_scenes(count: int, seed: int) -> list:
    """`count` scenes of the built-in generator (its image questions' images, in order)."""
    scenes, batch = [], max(count, 16)
    while len(scenes) < count:
        samples = generate_samples(batch, seed + len(scenes), video_share=0.0)
        scenes += [scene for sample in samples for scene in sample.scenes]
    return scenes[:count]


def vocabulary() -> list[str]:
    """The alphabetic words the built-in tiny tokenizer was trained on (about 1.5 tokens each)."""
    words = {word.strip(".?;").lower() for text in corpus_texts() for word in text.split()}
    return sorted(word for word in words if word.isalpha())


def _words(rng: random.Random, words: list[str], low: int, high: int) -> str:
    count = round(low * (high / low) ** rng.random())
    return " ".join(rng.choices(words, k=count))


def records(count: int, images: list[str], seed: int) -> Iterator[dict]:
    """`count` LLaVA records over the image paths `images`, from one stream seeded by `seed`."""
    rng = random.Random(seed)
    words = vocabulary()
    for index in range(count):
        chosen = rng.sample(images, rng.choices(IMAGES_PER_RECORD, IMAGES_PER_RECORD_WEIGHTS)[0])
        turns = []
        for turn in range(rng.randint(1, MAX_TURNS)):
            question = _words(rng, words, *QUESTION_WORDS) + "?"
            if turn == 0 and chosen:
                question = "<image>\n" * len(chosen) + question
            turns += [{"from": "human", "value": question}, {"from": "gpt", "value": _words(rng, words, *ANSWER_WORDS)}]
        record = {"id": f"llava-{index:07d}", "conversations": turns}
        if chosen:
            record["image"] = chosen[0] if len(chosen) == 1 else chosen
        yield record


def write_llava_records(out: Path, count: int, images: int = 64, seed: int = 0) -> Path:
    """Write `out`/images/ (`images` PNGs) and `out`/data.jsonl (`count` records); returns the JSONL's path."""
    if count < 1 or images < max(IMAGES_PER_RECORD):
        raise ValueError(f"--records must be >= 1 and --images >= {max(IMAGES_PER_RECORD)}, got {count}, {images}.")
    (out / "images").mkdir(parents=True, exist_ok=True)
    paths = []
    for index, scene in enumerate(pool_scenes(images, seed)):
        relative = f"images/pool_{index:05d}.png"
        draw_scene(scene).save(out / relative, optimize=False, compress_level=1)
        paths.append(relative)
    path = out / "data.jsonl"
    staging = out / f"data.jsonl.tmp-{os.getpid()}"
    with staging.open("w") as handle:
        for record in records(count, paths, seed):
            handle.write(json.dumps(record) + "\n")
    staging.replace(path)
    return path


IMAGE_SIDE = 448  # long samples' image: 256 merged tokens with 14-pixel patches and 2x2 merging


def passage(words: list[str], count: int, rng: random.Random) -> str:
    """`count` words drawn in order from a random start in `words`, wrapping around."""
    start = rng.randrange(len(words))
    return " ".join(itertools.islice(itertools.cycle(words[start:] + words[:start]), count))


def write_long_samples(out: Path, words: int, count: int, seed: int = 0) -> Path:
    """Write `out`/scene.png and `out`/data.jsonl with `count` records of about `words` words; returns the JSONL."""
    if words < 2 or count < 1:
        raise ValueError(f"--words must be >= 2 and --count >= 1, got {words} and {count}.")
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    scene = next(sample.scenes[0] for sample in generate_samples(50, seed, video_share=0.0) if sample.scenes)
    draw_scene(scene).resize((IMAGE_SIDE, IMAGE_SIDE)).save(out / "scene.png")
    vocabulary = " ".join(text for text in corpus_texts() if "\n" not in text).split()
    path = out / "data.jsonl"
    with path.open("w") as f:
        for index in range(count):
            text = passage(vocabulary, words, rng).split(" ")
            half = len(text) // 2
            turns = [
                {"from": "human", "value": "<image>\nRepeat this passage: " + " ".join(text[:half])},
                {"from": "gpt", "value": " ".join(text[half:])},
            ]
            f.write(json.dumps({"id": f"long-{words}-{index:04d}", "image": "scene.png", "conversations": turns}))
            f.write("\n")
    return path
