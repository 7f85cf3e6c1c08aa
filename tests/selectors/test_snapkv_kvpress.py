"""snapkv's options set to NVIDIA kvpress's ``SnapKVPress`` reproduce kvpress's kept set.

kvpress is not a dependency (its pins conflict with transformers 5.24). :func:`kvpress_kept` is
an independent plain-PyTorch transcription, written for this test, of

* ``SnapKVPress.compute_window_attention`` and ``SnapKVPress.score``
  (``kvpress/presses/snapkv_press.py``, NVIDIA/kvpress commit 00dd63a3): the last
  ``window_size`` queries against every key (``repeat_kv``), scale ``1/sqrt(head_dim)``, a causal
  ``triu(-inf, diagonal=q_len - window_size + 1)`` mask, softmax in fp32, the prefix columns
  ``[..., :-window_size]``, mean over the window queries, ``F.avg_pool1d(kernel_size,
  padding=kernel_size // 2, stride=1)`` per query head, mean over each KV group, and the window
  padded back with the score maximum so that it is kept;
* ``ScorerPress.compress`` (``kvpress/presses/scorer_press.py``, commit 0603dec4):
  ``n_kept = max(1, int(k_len * (1 - compression_ratio)))`` and ``scores.topk(n_kept)``.

Defaults there: ``window_size=64``, ``kernel_size=5``. The queries here stand for kvpress's
``query_states`` after RoPE (kvsieve's layer receives them rotated already).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from snapkv_variants import KVPRESS, jaccard

from harness import Harness

HKV, G, D, L = 2, 3, 16, 512


def kvpress_kept(q: torch.Tensor, k: torch.Tensor, window_size: int, kernel_size: int,
                 compression_ratio: float) -> list[set[int]]:
    """kvpress's kept positions per KV head; ``q [L, Hq, D]``, ``k [L, Hkv, D]`` fp32, batch 1."""
    q_len, num_heads, head_dim = q.shape
    num_key_value_heads = k.shape[1]
    groups = num_heads // num_key_value_heads
    query_states = q[-window_size:].transpose(0, 1).unsqueeze(0)  # [1, Hq, W, D]
    keys = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    key_states = keys[:, :, None].expand(1, num_key_value_heads, groups, q_len, head_dim).reshape(
        1, num_heads, q_len, head_dim)  # repeat_kv
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    attention_mask = torch.triu(torch.ones_like(attn_weights) * float("-inf"), diagonal=q_len - window_size + 1)
    attn_weights = torch.softmax(attn_weights + attention_mask, dim=-1, dtype=torch.float32)
    attn_weights = attn_weights[..., :-window_size]
    scores = attn_weights.mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel_size, padding=kernel_size // 2, stride=1)
    scores = scores.view(1, num_key_value_heads, groups, q_len - window_size).mean(2)
    scores = F.pad(scores, (0, window_size), value=scores.max().item())
    n_kept = max(1, int(q_len * (1 - compression_ratio)))
    indices = scores.topk(n_kept, dim=-1).indices[0]
    return [set(indices[h].tolist()) for h in range(num_key_value_heads)]


def snapkv_kept(options: dict, prompt_budget: int, q, k, v) -> list[set[int]]:
    h = Harness("snapkv", options | {"prompt_budget": prompt_budget}, hkv=HKV, g=G, d=D)
    idx, off = h.selector.predict_kv(h.hook_inputs([0], [L], 1, q, k, v))
    assert off.tolist() == [0, prompt_budget]
    return [set(idx[hd].tolist()) for hd in range(HKV)]


@pytest.fixture(scope="module")
def qkv():
    gen = torch.Generator().manual_seed(1234)
    h = Harness(None, hkv=HKV, g=G, d=D)
    q, k, v = h.qkv(L, gen)
    return q * 2.0, k, v  # a little peaked, like real attention


@pytest.mark.parametrize("compression_ratio", [0.5, 0.75])
def test_kvpress_option_set_reproduces_kvpress(qkv, compression_ratio):
    assert KVPRESS == {"window_size": 64, "kernel_size": 5, "pooling": "avg", "softmax_over": "all",
                       "group_sum": "after_pool"}
    q, k, v = qkv
    want = kvpress_kept(q, k, 64, 5, compression_ratio)
    got = snapkv_kept(KVPRESS, int(L * (1 - compression_ratio)), q, k, v)
    assert got == want
    assert all(set(range(L - 64, L)) <= s for s in got)  # the window is kept


@pytest.mark.parametrize("change", [{"window_size": 32}, {"kernel_size": 7}, {"pooling": "max"},
                                    {"softmax_over": "prefix"},
                                    {"window_size": 32, "kernel_size": 7, "pooling": "max",
                                     "softmax_over": "prefix", "group_sum": "before_pool"}])
def test_other_option_sets_keep_other_tokens(qkv, change):
    q, k, v = qkv
    want = kvpress_kept(q, k, 64, 5, 0.75)
    got = snapkv_kept(KVPRESS | change, L // 4, q, k, v)
    assert jaccard(got, want) < 1.0


def test_group_sum_order_matters_only_for_max_pooling(qkv):
    """Average pooling is linear, so summing the group before or after it keeps the same set."""
    q, k, v = qkv
    sets = {(pool, gs): snapkv_kept(KVPRESS | {"pooling": pool, "group_sum": gs}, L // 4, q, k, v)
            for pool in ("avg", "max") for gs in ("before_pool", "after_pool")}
    assert sets["avg", "before_pool"] == sets["avg", "after_pool"]
    assert sets["max", "before_pool"] != sets["max", "after_pool"]


@pytest.mark.parametrize("options", [KVPRESS, KVPRESS | {"pooling": "max", "group_sum": "before_pool"},
                                     KVPRESS | {"softmax_over": "prefix", "window_size": 32, "kernel_size": 7}])
def test_fast_path_equals_reference_per_option_set(options):
    """Two prompts of different lengths in one step (padding) plus one below the budget."""
    h = Harness("snapkv", options | {"prompt_budget": 96}, hkv=HKV, g=G, d=D)
    lens = [300, 170, 80]
    q, k, v = h.qkv(sum(lens), torch.Generator().manual_seed(4))
    inputs = h.hook_inputs([0, 1, 2], lens, 3, q * 2.0, k, v)
    fast, ref = h.selector.predict_kv(inputs), h.selector.predict_kv_naive(inputs)
    assert torch.equal(fast[1], ref[1]) and torch.equal(fast[0], ref[0])
