"""`python -m scripts.distributed_parity`: the multi-GPU layouts against one GPU (curves, gradient norm, throughput).
The command line of verification/parity.py, whose docstring (and `--help`) says what it measures and how."""

import sys

from verification.parity import main

if __name__ == "__main__":
    sys.exit(main())
