"""`python -m scripts.bench_lora`: LoRA against full fine-tuning on one GPU. The command line of
verification/lora_bench.py, whose docstring (and `--help`) says what it measures and how."""

import sys

from verification.lora_bench import main

if __name__ == "__main__":
    sys.exit(main())
