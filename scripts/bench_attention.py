"""`python -m scripts.bench_attention`: the packed attention engines (fa2, fa4, flex) on the recipes' shapes. The
command line of verification/lever_bench.py, whose docstring (and `--help`) says what it measures and how."""

import sys

from verification.lever_bench import attention_main as main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
