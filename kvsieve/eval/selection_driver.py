"""The positions a selector keeps for captured queries, from the selector itself: a one-layer
:class:`~kvsieve.sparse.Engine` holds the captured keys and the query rows run through
:class:`~kvsieve.sparse.SparseAttention` with the selector installed, as one generation step.

Reports that measure a selector on captured attention (:mod:`.mass_recall`) call
:func:`kept_positions` instead of restating the selector's rule. The prefix before the rows is
written into the cache without computing attention, and the selector rebuilds its per-token
state from there (``on_attach``); a selector that cannot (DSA, whose index keys come from the
hidden states) sees the prefix as a dense context step instead, with its model inputs.
"""
from __future__ import annotations

import dataclasses

import torch

from ..metadata import KVCacheManager, KVCacheSpec
from ..selectors import IndexerInputs
from ..selectors.dsa.projections import IndexerProjections
from ..sparse import Engine, SparseAttention, SparseAttentionConfig, attach_refusal, lower_config, selection_mask

__all__ = ["kept_positions"]

_TOKENS_PER_BLOCK = 64  # a multiple of every page and block size the reports use (16, 128 via pages)


def kept_positions(config: SparseAttentionConfig, q: torch.Tensor, k: torch.Tensor, first: int, scale: float, *,
                   hidden: torch.Tensor | None = None, projections: IndexerProjections | None = None
                   ) -> torch.Tensor:
    """Bool ``[R, Hkv, first + R]``: the positions the selector of ``config`` (run on the rows
    only, as generation rows) attends for query
    rows ``q [R, Hq, D]`` at positions ``first .. first + R - 1`` over keys ``k [>= first + R, Hkv,
    D]`` (row ``r`` sees ``[0, first + r]``), softmax scale ``scale``. ``hidden [>= first + R,
    hidden_size]`` and ``projections`` feed a selector that reads indexer inputs (``dsa``)."""
    rows, hkv, d = q.shape[0], k.shape[1], k.shape[2]
    n = first + rows
    if first < 1 or k.shape[0] < n:
        raise ValueError(f"kept_positions: rows at {first}..{n - 1} need a prefix (first >= 1) and {n} keys, "
                         f"got first={first} and {k.shape[0]} keys")
    plan = lower_config(dataclasses.replace(config, phases=("generation",)), num_layers=1)[0]
    reads_index = plan.selector.model_inputs_type is IndexerInputs
    if reads_index:
        if hidden is None or projections is None:
            raise ValueError(f"kept_positions: selector {config.selector!r} needs hidden states and projections")
        plan.selector.set_projections({0: projections})
    blocks = -(-n // _TOKENS_PER_BLOCK)
    spec = KVCacheSpec(num_layers=1, num_blocks=blocks + 1, tokens_per_block=_TOKENS_PER_BLOCK, num_kv_heads=hkv,
                       head_dim=d, max_requests=1, max_blocks_per_seq=blocks)
    layer = SparseAttention(layer_idx=0, num_q_heads=q.shape[1], num_kv_heads=hkv, head_dim=d, plan=plan,
                            sm_scale=scale)
    engine = Engine(KVCacheManager(spec), [layer], max_num_requests=1, max_num_tokens=max(first, rows))
    k = k[:n].float()
    v = torch.zeros_like(k)  # only the selection is read
    extra = (lambda a, b: IndexerInputs(hidden=hidden[a:b])) if reads_index else (lambda a, b: None)
    if attach_refusal(plan.selector) is None:  # rebuilds its state from the cache: no prefix attention
        md = engine.begin_step([0], [first], 1)
        engine.cache.write(0, md.slots[md.token_to_req_host], md.positions_host, k[:first], v[:first])
        engine.end_step()
    else:
        prefix_q = torch.zeros(first, q.shape[1], d)
        engine.step([0], [first], 1, [(prefix_q, k[:first], v[:first])], model_inputs=[extra(0, first)])
    md = engine.begin_step([0], [rows], 0)
    try:
        params = layer.forward(q.float(), k[first:], v[first:], md, model_inputs=extra(first, n)).params
        mask = selection_mask(params, slice(0, rows), md.token_kv_lens, n, hkv)  # [Hkv, R, n]
    finally:
        engine.abort_step()
    return mask.transpose(0, 1)
