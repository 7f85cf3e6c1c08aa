from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_model():
    from kvsieve.eval.model import tiny_random_llama

    return tiny_random_llama(seed=0, num_layers=2, max_positions=4096)


@pytest.fixture
def prompt_ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (1, 48), generator=g)
