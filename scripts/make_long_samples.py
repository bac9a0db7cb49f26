"""Write a dataset of long samples: one image and about N words of text each, for the longest sample that trains
(context parallelism; the built-in data's samples stay under ~1.2k tokens).

    python -m scripts.make_long_samples --out data/long-32000 --words 32000 [--count 40] [--seed 0]
    python train.py --config recipes/bench-qwen2_5_vl-3b-shape.yaml data.path=data/long-32000/data.jsonl \
        data.eval_fraction=0 packing.max_tokens=64512 ...      # 2 x words + 512: one sample per pack

Each record is LLaVA-style: a user turn with the image and half of the words (a passage to repeat), an assistant
turn with the other half, so about half of the tokens are trained. The words come from the built-in dataset's own
conversations (the built-in tiny tokenizer knows them: about 1.5 tokens per word, so a sample is about
1.5 x words + 300 tokens and `packing.max_tokens` = 2 x words + 512 holds exactly one); the image is one of the
built-in scenes at 448x448 (256 merged tokens with 14-pixel patches and 2x2 merging, within the recipe's pixel
bounds). Same arguments, same files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from verification.bench_data import write_long_samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for scene.png and data.jsonl")
    parser.add_argument("--words", type=int, required=True, help="words of text per sample (about one token each)")
    parser.add_argument("--count", type=int, default=40, help="samples")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_long_samples(Path(args.out), args.words, args.count, args.seed))


if __name__ == "__main__":
    main()
