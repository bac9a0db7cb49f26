"""Write a large LLaVA JSONL over a small pool of images: the data for measuring the pipeline at scale.

    python -m scripts.make_llava_records --out data/llava-1m --records 1000000 [--images 64] [--seed 0]
    python train.py --config recipes/tiny-qwen2_5_vl.yaml data.path=data/llava-1m/data.jsonl

`--out` receives images/pool_NNNNN.png (`--images` built-in scenes, data/synthetic.py) and data.jsonl: `--records`
LLaVA/ShareGPT records (`id`, `image` a relative path or a list of two, `conversations` with from/value). A record
holds no image (15%), one (70%) or two (15%), and 1-4 question/answer turns whose answers run from 2 to 240 words
(log-uniform) of the built-in tokenizer's vocabulary: with the tiny recipes, samples of ~30 to ~1,100 tokens, ~300 on
average; the few over the recipes' 1024-token budget are counted too_long skips, as in real data. Records are
written one at a time (constant memory for any count) from one seeded stream; same arguments, same files. The JSONL
is written under a temporary name and renamed, so an interrupted run never leaves a file that looks complete.
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for images/ and data.jsonl")
    parser.add_argument("--records", type=int, required=True, help="records to write")
    parser.add_argument("--images", type=int, default=64, help="images in the pool the records share")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_llava_records(Path(args.out), args.records, args.images, args.seed))


if __name__ == "__main__":
    main()
