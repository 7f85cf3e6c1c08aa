"""The DSA indexer's logits of a layer step in row chunks, for the top-k of the torch path
(:meth:`~kvsieve.selectors.dsa.DSASelector.predict_attn` where the one-call native selection does
not apply)."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from ...sparse import SelectorInputs

__all__ = ["logits_chunks"]


def logits_chunks(inputs: SelectorInputs, q: torch.Tensor, w: torch.Tensor, k_pool: torch.Tensor,
                  s_pool: torch.Tensor | None, kernel: str, budget: int
                  ) -> Iterator[tuple[slice, torch.Tensor]]:
    """Yield ``(rows slice, logits [n, width])`` fp32 in row chunks of at most ``budget`` logits
    (rows x width). ``q [T, H, Di]`` / ``w [T, H]``: the step's index queries and weights (the
    metadata's row order); ``k_pool [num_blocks, tokens_per_block, Di]`` and, for FP8 keys,
    ``s_pool [num_blocks, tokens_per_block]``: the layer's key pools; ``kernel``: ``"triton"`` or
    ``"reference"``. A context request without cached history uses the ragged prefill path over its
    own keys (read back from the pool, so both paths score the stored values), one request at a
    time; the other rows (decode, chunked-prefill continuations) take the paged decode path,
    consecutive requests batched into one chunk."""
    if kernel == "triton":
        from ...kernels.dsa_indexer import triton as impl
    else:
        from ...kernels.dsa_indexer import naive as impl
    md = inputs.metadata
    lens = md.token_kv_lens
    lens_host = inputs.token_kv_lens_host()
    qs = md.query_start_host

    def paged(c0: int, c1: int) -> tuple[slice, torch.Tensor]:
        w_c = int(lens_host[c0:c1].max())
        return slice(c0, c1), impl.indexer_logits_decode(q[c0:c1], k_pool, s_pool, w[c0:c1], md.block_table,
                                                          md.token_to_req[c0:c1], lens[c0:c1], w_c)

    span: list[int] = []  # [first row, end row, widest row] of the paged rows not yet yielded
    for i in inputs.requests:
        t0, t1 = int(qs[i]), int(qs[i + 1])
        if t1 == t0:
            continue
        if md.is_context(i) and int(md.kv_lens_host[i]) == t1 - t0:
            if span:
                yield paged(span[0], span[1])
                span = []
            blk, off = inputs.cache.physical(np.full(t1 - t0, md.slots[i], dtype=np.int32),
                                             np.arange(t1 - t0, dtype=np.int32))
            keys = k_pool[blk, off]
            scales = None if s_pool is None else s_pool[blk, off]
            step = max(1, budget // max(int(lens_host[t1 - 1]), 1))
            for c0 in range(t0, t1, step):
                c1 = min(t1, c0 + step)
                start = torch.zeros(c1 - c0, dtype=torch.int32, device=lens.device)
                yield slice(c0, c1), impl.indexer_logits_prefill(q[c0:c1], keys, scales, w[c0:c1], start,
                                                                 lens[c0:c1], int(lens_host[c0:c1].max()))
            continue
        width = max(int(lens_host[t1 - 1]), 1)
        if t1 - t0 == 1:  # a decode row joins the open span unless that breaks the budget
            if span and (span[1] != t0 or (t1 - span[0]) * max(span[2], width) > budget):
                yield paged(span[0], span[1])
                span = []
            span = [span[0], t1, max(span[2], width)] if span else [t0, t1, width]
            continue
        if span:
            yield paged(span[0], span[1])
            span = []
        step = max(1, budget // width)
        for c0 in range(t0, t1, step):
            yield paged(c0, min(t1, c0 + step))
    if span:
        yield paged(span[0], span[1])
