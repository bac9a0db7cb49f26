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
from pathlib import Path

from verification.bench_data import write_llava_records


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
