"""Page machinery shared by the paged selectors: page summaries and their top-k (``page_summary``), the
page-selector base (``page_selector``), row/column helpers on the selector carrier (``paged``) and
prompt scoring for the prefill-pruning selectors (``prefill_scoring``).

Kernels: :mod:`kvsieve.kernels.page_topk` (page scores and their top-k, native on the CPU).
"""
from __future__ import annotations
