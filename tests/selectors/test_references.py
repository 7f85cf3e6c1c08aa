"""Every registered selector that declares ``predict_attn_naive`` agrees with it on a mixed batch
(a fresh prompt, a chunked-prefill continuation and decodes), at its configuration in
tests/default_selectors.py (its own defaults for a selector not listed there), and on a
sliding-window layer where it declares window support. Rows of 170-300 tokens against budgets of
24-64: the selections really are sparse."""
from __future__ import annotations

import pytest
import torch

from default_selectors import DEFAULT_SELECTORS
from harness import Harness, reference_params
from kvsieve.sparse import available_selectors, get_selector_class
from kvsieve.sparse.selector_step import place_rows

WITH_REFERENCE = sorted(n for n in available_selectors()
                        if get_selector_class(n).predict_attn_naive is not None)


def test_the_page_and_block_selectors_declare_a_reference():
    assert {"block_select", "quest", "rocketkv"} <= set(WITH_REFERENCE)


@pytest.mark.parametrize("name, window", [(n, None) for n in WITH_REFERENCE] + [
    (n, 100) for n in WITH_REFERENCE if get_selector_class(n).capabilities.sliding_window])
def test_fast_path_equals_reference(name, window):
    h = Harness(name, DEFAULT_SELECTORS.get(name, {}), hkv=2, g=2, d=32, window=window)
    gen = torch.Generator().manual_seed(11)
    skipped = False
    for rids, lens, ctx in (([1, 2], [300, 170], 2), ([3, 1, 2], [90, 1, 1], 1), ([3, 1, 2], [40, 1, 1], 1)):
        q, k, v = h.qkv(sum(lens), gen)
        inputs = h.hook_inputs(rids, lens, ctx, q, k, v)
        fast = place_rows(h.selector.predict_attn(inputs), inputs, name)
        ref = reference_params(h.selector, inputs)
        assert (fast is None) == (ref is None)
        if fast is not None:
            assert fast.selected_phases == ref.selected_phases
            assert torch.equal(fast.sparse_attn_offsets, ref.sparse_attn_offsets)
            assert torch.equal(fast.sparse_attn_indices, ref.sparse_attn_indices)
            unit, lens = fast.sparse_attn_indices_block_size, inputs.metadata.token_kv_lens
            for t in range(len(fast.sparse_attn_offsets) - 1):
                u = fast.sparse_attn_indices[:, int(fast.sparse_attn_offsets[t]): int(fast.sparse_attn_offsets[t + 1])]
                skipped |= int((u >= 0).sum(-1).max()) * unit < int(lens[t])
            if window is not None:  # every chosen unit overlaps its row's window
                unit, idx, off = fast.sparse_attn_indices_block_size, fast.sparse_attn_indices, fast.sparse_attn_offsets
                lens = inputs.metadata.token_kv_lens
                for t in range(len(off) - 1):
                    u = idx[:, int(off[t]): int(off[t + 1])]
                    assert bool((((u + 1) * unit > int(lens[t]) - window) | (u < 0)).all())
        h.engine.end_step()
    assert skipped, f"{name} selected every position of every row: nothing was compared on a sparse selection"
