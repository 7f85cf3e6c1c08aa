"""``python -m kvsieve.eval`` is ``kvsieve eval``."""
from __future__ import annotations

import sys

from ..cli import main

sys.exit(main(["eval", *sys.argv[1:]]))
