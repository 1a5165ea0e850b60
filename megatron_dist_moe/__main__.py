"""`python -m megatron_dist_moe plan|demo ...` (see megatron_dist_moe.cli)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
