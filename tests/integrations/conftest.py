from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))  # families.py
