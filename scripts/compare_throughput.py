"""`python -m scripts.compare_throughput`: the same recipe trained with the fused mRoPE kernels and without (and
other variants), one train.py process per run, the variants alternating. The command line of
verification/throughput_compare.py, whose docstring (and `--help`) says what it measures and how."""

import sys

from verification.throughput_compare import command_line

if __name__ == "__main__":
    sys.exit(command_line())
