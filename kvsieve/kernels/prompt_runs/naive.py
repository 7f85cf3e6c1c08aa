"""The plain-PyTorch reference of :func:`.native.prompt_runs_native`: the same arguments and result,
computed as a masked dense softmax over every position of the cache (no runs walked in order)."""
from __future__ import annotations

import torch

from ..common.runs import TokenRuns

__all__ = ["prompt_runs_naive"]


def prompt_runs_naive(k: torch.Tensor, v: torch.Tensor, runs: TokenRuns, q: torch.Tensor, *, sm_scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [N, Hq, D] fp32, lse [N, Hq] fp32)``: per KV head, the scores of every row against every
    cached token ``[N, G, num_blocks * block_size]``, ``-inf`` where the row's runs do not reach, a
    softmax in fp32; a (row, KV head) without tokens has out 0 and lse ``+inf``."""
    n_rows, hq, d = q.shape
    num_blocks, hkv, bs, _ = k.shape
    g = hq // hkv
    out = torch.zeros(n_rows, hq, d, dtype=torch.float32)
    lse = torch.full((n_rows, hq), torch.inf, dtype=torch.float32)
    for h in range(hkv):
        mask = torch.zeros(n_rows, num_blocks * bs, dtype=torch.bool)
        for n in range(n_rows):
            a, b = int(runs.ptr[h * n_rows + n]), int(runs.ptr[h * n_rows + n + 1])
            for u in range(a, b):
                first = int(runs.block[u]) * bs + int(runs.start[u])
                mask[n, first: first + int(runs.cnt[u])] = True
        keys, vals = k[:, h].reshape(-1, d).float(), v[:, h].reshape(-1, d).float()  # [num_blocks * bs, D]
        s = torch.einsum("ngd,td->ngt", q[:, h * g:(h + 1) * g].float(), keys) * sm_scale
        s = s.masked_fill(~mask[:, None], -torch.inf)
        some = mask.any(1)
        lse[some, h * g:(h + 1) * g] = torch.logsumexp(s[some], -1)
        out[some, h * g:(h + 1) * g] = torch.softmax(s[some], -1) @ vals
    return out, lse
