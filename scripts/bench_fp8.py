"""`python -m scripts.bench_fp8`: FP8 linears against bf16 on the recipes' layer shapes. The
command line of verification/lever_bench.py, whose docstring (and `--help`) says what it measures and how."""

import sys

from verification.lever_bench import fp8_main as main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
