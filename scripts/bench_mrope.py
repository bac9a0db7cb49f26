"""`python -m scripts.bench_mrope`: the rope kernels against their peers and the copy floor. The command line of
verification/rope_bench.py, whose docstring (and `--help`) says what it measures and how."""

import sys

from verification.rope_bench import main

if __name__ == "__main__":
    sys.exit(main())
