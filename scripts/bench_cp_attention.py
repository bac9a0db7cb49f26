"""`python -m scripts.bench_cp_attention`: context parallelism's attention against torch's ring. The command line of
verification/cp_attention_bench.py, whose docstring (and `--help`) says what it measures and how."""

import sys

from verification.cp_attention_bench import main

if __name__ == "__main__":
    sys.exit(main())
