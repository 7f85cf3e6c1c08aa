"""``python -m kvsieve.gpu_check [--dry-run] [--out DIR]``: see :mod:`kvsieve.gpu_check.driver`."""
from __future__ import annotations

import sys

from .driver import main

if __name__ == "__main__":
    sys.exit(main())
