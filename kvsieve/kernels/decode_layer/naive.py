"""Plain-PyTorch reference of ``kvsieve_decode_layer`` (the op's contract: ``__init__.py``), one row,
one KV head and one rule at a time, fp32. Writes the same per-block state (the newest page's summary
recomputed from its keys, the row's index key) and returns the same ``attended``."""
from __future__ import annotations

import numpy as np
import torch

from .plan import DecodeProgram, IndexerStep

__all__ = ["decode_layer_naive"]


def _top(score: torch.Tensor, k: int) -> list[int]:
    """The ``k`` best entries of ``score`` (ties to the lower index), ascending."""
    order = torch.sort(score, descending=True, stable=True).indices[:k]
    return sorted(order.tolist())


def _units_positions(units: list[int], unit: int, length: int) -> list[int]:
    return [p for u in units for p in range(u * unit, min((u + 1) * unit, length))]


def _refresh_page(program: DecodeProgram, keys: torch.Tensor, blocks: np.ndarray, length: int, block_size: int) -> None:
    """The summary of the page holding position ``length - 1`` recomputed from ``keys [L, Hkv, D]``."""
    ps = program.page_size
    first = (length - 1) // ps * ps
    page = keys[first:length]
    blk, sub = int(blocks[first // block_size]), (first % block_size) // ps
    program.pool[blk, :, sub, 0] = page.amin(0).to(program.pool.dtype)
    program.pool[blk, :, sub, 1] = page.amax(0).to(program.pool.dtype)


def _page_rows(program: DecodeProgram, blocks: np.ndarray, n_pages: int, block_size: int) -> torch.Tensor:
    """fp32 ``[n_pages, Hkv, 2, D]``: the row's page summaries as stored."""
    sub = block_size // program.page_size
    return torch.stack([program.pool[int(blocks[p // sub]), :, p % sub] for p in range(n_pages)]).float()


def _bound(qg: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """``[G, n]``: ``sum_d max(q_d min_d, q_d max_d)`` of ``qg [G, D]`` against ``kmin``/``kmax [n, D]``."""
    return torch.maximum(qg[:, None] * kmin[None], qg[:, None] * kmax[None]).sum(-1)


def _select(program: DecodeProgram, qn: torch.Tensor, keys: torch.Tensor, blocks: np.ndarray, length: int,
            block_size: int, sm_scale: float, h: int, index: tuple[torch.Tensor, torch.Tensor] | None) -> list[int]:
    """Head ``h``'s selected positions of one row: ``qn [Hkv, G, D]``, ``keys [L, Hkv, D]`` fp32."""
    p, unit = program, program.unit
    n_units = -(-length // unit)
    k = min(p.units, n_units)
    if p.kind == "streaming":
        sink = min(p.num_sink, length)
        return sorted(set(range(sink)) | set(range(max(length - (p.units - p.num_sink), sink), length)))
    if p.kind == "indexer":
        if length <= p.units:
            return list(range(length))
        iq, iw = index
        ik = torch.stack([p.index_keys[int(blocks[s // block_size]), s % block_size] for s in range(length)]).float()
        score = (iw[:, None] * (iq @ ik.T).relu()).sum(0)
        return _top(score, p.units)
    qg = qn[h].float()
    if p.kind == "pages":
        summ = _page_rows(p, blocks, n_units, block_size)[:, h]  # [n, 2, D]
        if p.mode == "bound":
            logits = _bound(qg, summ[:, 0], summ[:, 1])
        else:  # sign: max where the group's summed channel is positive, min elsewhere
            logits = qg @ torch.where(qg.sum(0) > 0, summ[:, 1], summ[:, 0]).T
        score = torch.softmax(logits * sm_scale, dim=-1).mean(0)
        score[n_units - 1] = 2.0
        return _units_positions(_top(score, k), unit, length)
    if p.kind == "tokens_exact":
        mass = torch.softmax(qg @ keys[:, h].T * sm_scale, dim=-1).sum(0)
        per_unit = torch.zeros(n_units).index_add_(0, torch.arange(length) // unit, mass)
        return _units_positions(_top(per_unit, k), unit, length)
    # blocks: the group's largest score per block, the first / last blocks forced
    if p.kind == "blocks_bound":
        summ = _page_rows(p, blocks, -(-length // p.page_size), block_size)[:, h]
        per = unit // p.page_size
        score = torch.stack([_bound(qg, summ[u * per:(u + 1) * per, 0].amin(0)[None],
                                    summ[u * per:(u + 1) * per, 1].amax(0)[None])[:, 0].max() * sm_scale
                             for u in range(n_units)])
    else:
        logits = qg @ keys[:, h].T * sm_scale  # [G, L]
        reduce = (lambda x: x.amax(-1)) if p.mode == "max" else (lambda x: x.mean(-1))
        score = torch.stack([reduce(logits[:, u * unit:(u + 1) * unit]).max() for u in range(n_units)])
    forced = (torch.arange(n_units) < p.init_units) | (torch.arange(n_units) >= n_units - p.local_units)
    return _units_positions(_top(score.masked_fill(forced, float("inf")), k), unit, length)


def decode_layer_naive(k: torch.Tensor, v: torch.Tensor, program: DecodeProgram, table: np.ndarray,
                       kv_lens: np.ndarray, q: torch.Tensor, *, sm_scale: float, index: IndexerStep | None = None
                       ) -> tuple[torch.Tensor, np.ndarray]:
    """``(out [N, Hq, D] fp32, attended [N, Hkv] int64)`` of the decode rows, arguments as
    :meth:`~.native.DecodeLayerCall.run` (``k``/``v [num_blocks, Hkv, block_size, D]`` any strides);
    the program's pools are written as the kernel writes them."""
    num_blocks, hkv, block_size, d = k.shape
    n, hq, _ = q.shape
    out = torch.zeros(n, hq, d)
    attended = np.zeros((n, hkv), dtype=np.int64)
    for r in range(n):
        length, blocks = int(kv_lens[r]), table[r]
        pos = torch.arange(length)
        blk = torch.from_numpy(blocks.astype(np.int64))[pos // block_size]
        keys, values = k[blk, :, pos % block_size].float(), v[blk, :, pos % block_size].float()  # [L, Hkv, D]
        if program.kind in ("pages", "blocks_bound"):
            _refresh_page(program, k[blk, :, pos % block_size], blocks, length, block_size)
        row_index = None
        if program.kind == "indexer":
            last = length - 1
            program.index_keys[int(blocks[last // block_size]), last % block_size] = index.keys[r].to(
                program.index_keys.dtype)
            row_index = (index.q[r], index.weights[r])
        qn = q[r].float().view(hkv, hq // hkv, d)
        for h in range(hkv):
            sel = torch.tensor(_select(program, qn, keys, blocks, length, block_size, sm_scale, h, row_index))
            att = torch.softmax(qn[h] @ keys[sel, h].T * sm_scale, dim=-1)
            out[r, h * (hq // hkv):(h + 1) * (hq // hkv)] = att @ values[sel, h]
            attended[r, h] = len(sel)
    return out, attended
