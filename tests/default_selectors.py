"""One configuration per built-in selector, sized for the tests' small geometries (prompts of about
100 tokens, pages of 16, head_dim 16), as kvpress's ``tests/default_presses.py``: every
cross-selector test takes its list from here, and ``tests/selectors/test_defaults.py`` fails when a
built-in selector has no entry, so a new selector is covered by every such test once it is listed.

``NEEDS_MODEL_INPUTS``: selectors that also need per-step model inputs (DSA's
:class:`~kvsieve.selectors.dsa.IndexerInputs` and trained projections); tests that drive a bare
:class:`~kvsieve.Engine` without them leave these out. ``NO_INDICES``: selectors that hand the
kernels a threshold instead of indices (skip-softmax)."""
from __future__ import annotations

DEFAULT_SELECTORS: dict[str, dict[str, object]] = {
    "streaming": {"budget": 24, "num_sink": 4},
    "oracle_topk": {"budget": 32, "block_size": 8},
    "rocketkv": {"prompt_budget": 64, "window_size": 8, "kernel_size": 3, "page_size": 4, "topk": 6},
    "quest": {"budget": 32},
    "snapkv": {"prompt_budget": 48, "window_size": 8, "kernel_size": 3},
    "block_select": {"block_size": 16, "topk_blocks": 2},
    "skip_softmax": {"threshold_scale_factor_context": 10.0, "threshold_scale_factor_generation": 10.0},
    "dsa": {"index_topk": 16, "n_heads": 2, "head_dim": 16, "rope_dim": 8},
}

NEEDS_MODEL_INPUTS = frozenset({"dsa"})
NO_INDICES = frozenset({"skip_softmax"})


def index_selectors() -> dict[str, dict[str, object]]:
    """The entries that emit indices and run on a bare Engine (no model inputs)."""
    return {n: p for n, p in DEFAULT_SELECTORS.items() if n not in NEEDS_MODEL_INPUTS | NO_INDICES}
