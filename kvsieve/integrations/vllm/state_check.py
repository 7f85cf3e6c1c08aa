"""The plug-in's debug check of a selector's per-block state (``KVSIEVE_CHECK_STATE=1`` or
``check_state: true`` in ``KVSIEVE_CONFIG``): at every layer step, after the selector's
``on_append``, its state held per vLLM block is compared with a recomputation, and a difference
raises :class:`StateMismatch` naming the layer, the request row, the block and the page (or slot).

vLLM owns the blocks: it preempts requests and frees their blocks, frees an aborted request's
blocks mid-decode, hands cached prefix blocks to other requests and evicts them. The selector's
state lives in auxiliary pools indexed by vLLM's physical block ids
(:meth:`~kvsieve.metadata.foreign_paged.ForeignPagedKV.add_aux_pool`), so it is right only if it is
rewritten whenever a block's tokens change; a stale entry is a wrong selection with no error. What
is checked, per selector:

* **page summaries** (``quest``; ``block_select`` with ``scoring="summary"``): every page of every
  request in the step, ``[0, kv_len)``, is recomputed from vLLM's K cache (min and max over the
  page's valid keys in fp32, rounded to the summary dtype, as
  :func:`~kvsieve.kernels.page_minmax.naive.page_minmax_naive` writes them) and compared exactly
  (``==``, so ``+0 == -0``; NaN equals NaN) with the pool entry vLLM's block table points at. This
  covers the whole state the selector reads this step.
* **DSA index keys**: the keys cannot be recomputed from vLLM's cache (they are projections of the
  layer's hidden state, which vLLM does not keep). Checked: (1) every token of this step — its key,
  recomputed from this step's hidden state through the layer's projections
  (:meth:`~kvsieve.selectors.dsa.DSASelector.index_tensors`) and encoded as the pool stores it
  (:meth:`DSASelector.stored_keys`), equals the pool entry at the (block, slot) vLLM wrote its K/V
  to; (2) every earlier position of every request in the step equals the key the check verified
  when that position was written (a shadow copy kept here), and was verified at all. Not checked:
  that a key verified when written is the key the same tokens would get now (a prefix cached from
  another request's step holds that step's keys; vLLM's batching can change a hidden state in its
  last bits).

The check only reads: the pools, the cache and the selector's outputs are left as they were (the DSA
projections run once more on the step's hidden state). It costs a gather of every key of the step's
requests per layer and step: a debug and test option, off by default. Decode steps on the one-call
native path are checked after the call (:meth:`StateCheck.check_one_call`), so the state
checked is what each path wrote: the selector's hooks on prompt and mixed steps, the native kernel on
decode steps.
"""
from __future__ import annotations

import numpy as np
import torch

from ...selectors.block_select import BlockSelectSelector
from ...selectors.common.page_selector import PageSelectorBase
from ...selectors.dsa import DSASelector
from ...metadata import AttentionMetadata
from ...sparse import AttentionGeometry, LayerPlan, SelectorInputs, SparseSelector
from ...sparse.selector_step import selector_inputs

__all__ = ["StateCheck", "StateMismatch", "check_supported"]

OPTION = "check_state"


class StateMismatch(RuntimeError):
    """A selector's per-block state differs from its recomputation (the message names the layer,
    the request row of the step, the block and the page or slot)."""


def check_supported(selector: SparseSelector | None) -> None:
    """Refuse, by name, a selector whose per-block state the check does not know (``None``: the
    plug-in runs no selector, ``dense``)."""
    if selector is None:
        raise ValueError(f"kvsieve vLLM plug-in: {OPTION} checks a selector's per-block state, and 'dense' runs no "
                         "selector; turn it off or choose quest, block_select (scoring=summary) or dsa")
    if isinstance(selector, BlockSelectSelector) and selector.config.scoring != "summary":
        raise ValueError(f"kvsieve vLLM plug-in: {OPTION}: block_select with scoring={selector.config.scoring!r} "
                         "keeps no per-block state (only scoring='summary' keeps page summaries)")
    if not isinstance(selector, (PageSelectorBase, DSASelector)):
        raise ValueError(f"kvsieve vLLM plug-in: {OPTION}: selector {selector.name!r} keeps no per-block state the "
                         "check knows; it checks quest, block_select (scoring=summary) and dsa")


class StateCheck:
    """One per process (per vLLM worker). :meth:`check` runs after the selector's hooks of each
    layer step; for DSA it keeps, per layer, the keys it verified ``[num_blocks, block_size,
    head_dim]`` (the pool's dtype), their FP8 scales ``[num_blocks, block_size]`` when the pool has
    them, and which slots were verified ``[num_blocks, block_size]`` bool."""

    def __init__(self) -> None:
        self._shadows: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = {}

    def check(self, selector: SparseSelector, inputs: SelectorInputs) -> None:
        """Compare ``selector``'s per-block state for the step's requests with its recomputation
        (module docstring); raise :class:`StateMismatch` on the first difference."""
        if isinstance(selector, DSASelector):
            self._check_index_keys(selector, inputs)
        elif isinstance(selector, PageSelectorBase):
            check_page_summaries(selector, inputs)
        else:
            check_supported(selector)

    def check_one_call(self, plan: LayerPlan, layer_idx: int, geometry: AttentionGeometry, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata, model_inputs: object = None) -> None:
        """:meth:`check` of a decode step the one-call path ran (:data:`.router.ONE_CALL_DECODE`): the
        pools as the call left them. q ``[N, Hq, D]``, k/v ``[N, Hkv, D]`` (every row a decode row, so
        vLLM's order is kvsieve's), ``md`` the step prepared as the selector path would, ``model_inputs``
        the layer's, as handed to the call."""
        inputs = selector_inputs(q, k, v, md, layer_idx=layer_idx, geometry=geometry, plan=plan,
                                 model_inputs=model_inputs)
        self.check(plan.selector, inputs)

    def _check_index_keys(self, selector: DSASelector, inputs: SelectorInputs) -> None:
        md, cache, layer = inputs.metadata, inputs.cache, inputs.layer_idx
        k_pool, s_pool = selector.index_pools(inputs)
        _, k, _ = selector.index_tensors(layer, inputs.model_inputs, md.positions)  # k [T, Dk] fp32
        keys, scales = selector.stored_keys(k)  # [T, Dk] as the pool holds them, [T] or None
        rows = md.token_to_req_host[: md.num_tokens]
        blk, off = cache.physical(md.slots[rows], md.positions_host[: md.num_tokens])
        _compare(k_pool[blk, off], keys, layer, selector.name, "index key (recomputed from this step's hidden state)",
                 lambda i: _slot_where(int(rows[i]), int(md.positions_host[i]), int(blk[i]), int(off[i])))
        if s_pool is not None:
            _compare(s_pool[blk, off], scales, layer, selector.name, "index key scale",
                     lambda i: _slot_where(int(rows[i]), int(md.positions_host[i]), int(blk[i]), int(off[i])))
        shadow = self._shadow(layer, k_pool, s_pool)
        shadow[0][blk, off] = k_pool[blk, off]
        if s_pool is not None:
            shadow[1][blk, off] = s_pool[blk, off]
        shadow[2][blk, off] = True
        # the earlier positions of the step's requests: as verified when they were written
        earlier = md.cached_lens_host[: md.num_seqs].astype(np.int64)
        req = np.repeat(np.arange(md.num_seqs), earlier)
        if not req.size:
            return
        pos = np.arange(req.size) - np.repeat(np.cumsum(earlier) - earlier, earlier)
        blk, off = cache.physical(md.slots[req], pos)
        verified = shadow[2][blk, off]
        where = lambda i: _slot_where(int(req[i]), int(pos[i]), int(blk[i]), int(off[i]))  # noqa: E731
        if not bool(verified.all()):
            i = int((~verified).nonzero()[0, 0])
            raise StateMismatch(f"kvsieve vLLM plug-in {OPTION}: layer {layer}, selector {selector.name!r}: the index "
                                f"key at {where(i)} was never written by the selector (a position vLLM holds whose "
                                "key the plug-in did not compute)")
        _compare(k_pool[blk, off], shadow[0][blk, off], layer, selector.name,
                 "index key (as verified when written)", where)
        if s_pool is not None:
            _compare(s_pool[blk, off], shadow[1][blk, off], layer, selector.name,
                     "index key scale (as verified when written)", where)

    def _shadow(self, layer: int, k_pool: torch.Tensor, s_pool: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        if layer not in self._shadows:
            self._shadows[layer] = (torch.zeros_like(k_pool), None if s_pool is None else torch.zeros_like(s_pool),
                                    torch.zeros(k_pool.shape[:2], dtype=torch.bool, device=k_pool.device))
        return self._shadows[layer]


def check_page_summaries(selector: PageSelectorBase, inputs: SelectorInputs) -> None:
    """Every page of every request in the step: the pool's ``(min, max)`` ``[Hkv, 2, D]`` equals the
    recomputation from the K cache (module docstring)."""
    md, cache, layer = inputs.metadata, inputs.cache, inputs.layer_idx
    summaries = selector.summaries(inputs)
    ps, tpb, pool = summaries.page_size, cache.tokens_per_block, summaries.pools[layer]
    lens = md.kv_lens_host[: md.num_seqs].astype(np.int64)
    n_pages = -(-lens // ps)
    req = np.repeat(np.arange(md.num_seqs), n_pages)
    if not req.size:
        return
    page = np.arange(req.size) - np.repeat(np.cumsum(n_pages) - n_pages, n_pages)
    first = page * ps
    blocks = cache.block_table[md.slots[req], first // tpb].astype(np.int64)
    sub = (first % tpb) // ps
    counts = np.minimum(lens[req] - first, ps)
    # a page two requests of the step hold (a recomputed request's prompt part and generated part) is
    # summarized over the longer of them: keep that one
    key = blocks * (tpb // ps) + sub
    keep = np.lexsort((-counts, key))
    keep = np.sort(keep[np.r_[True, key[keep][1:] != key[keep][:-1]]])
    req, page, first, blocks, sub, counts = (a[keep] for a in (req, page, first, blocks, sub, counts))
    dev = pool.device
    tok = torch.from_numpy(first % tpb).unsqueeze(1) + torch.arange(ps)  # [n, ps] slot in the block
    valid = (torch.arange(ps) < torch.from_numpy(counts).unsqueeze(1)).to(dev)[:, :, None, None]
    blk = torch.from_numpy(blocks).to(dev)
    keys = cache.k_cache(layer)[blk.unsqueeze(1), :, tok.clamp(max=tpb - 1).to(dev)].float()  # [n, ps, Hkv, D]
    kmin = keys.masked_fill(~valid, float("inf")).amin(dim=1)
    kmax = keys.masked_fill(~valid, float("-inf")).amax(dim=1)
    expected = torch.stack([kmin, kmax], dim=2).to(pool.dtype)  # [n, Hkv, 2, D]
    got = pool[blk, :, torch.from_numpy(sub).to(dev)]
    _compare(got, expected, layer, selector.name, f"page summary ({ps}-token pages, recomputed from vLLM's cache)",
             lambda i: (f"request row {int(req[i])} of the step (kv_len {int(lens[req[i]])}), block {int(blocks[i])}, "
                        f"page {int(page[i])} of the request (page {int(sub[i])} of the block)"),
             lambda j: "head {}, {}, channel {}".format(j[0], ("min", "max")[j[1]], j[2]))


def _slot_where(row: int, position: int, block: int, slot: int) -> str:
    return f"request row {row} of the step, position {position}, block {block}, slot {slot} (page = one token)"


def _compare(got: torch.Tensor, expected: torch.Tensor, layer: int, selector: str, what: str, where,  # noqa: ANN001
             element=None) -> None:  # noqa: ANN001
    """Raise :class:`StateMismatch` at the first entry ``i`` (dim 0) where ``got`` and ``expected``
    (same shape) differ; ``where(i)`` names it, ``element(index)`` the element inside the entry."""
    a, b = got.float(), expected.float()
    same = (a == b) | (a.isnan() & b.isnan())
    if bool(same.all()):
        return
    bad = (~same).nonzero()[0].tolist()
    inner = f", {element(bad[1:])}" if element is not None else ""
    raise StateMismatch(
        f"kvsieve vLLM plug-in {OPTION}: layer {layer}, selector {selector!r}: {what} differs at {where(bad[0])}"
        f"{inner}: the pool holds {a[tuple(bad)].item()!r}, the check expects {b[tuple(bad)].item()!r} "
        f"({int((~same).reshape(same.shape[0], -1).any(1).sum())} of {same.shape[0]} entries differ)")
