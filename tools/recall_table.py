"""Recall of the true attention mass vs budget, per selector, on one seeded synthetic input.

Run ``python tools/recall_table.py``. The input is a single GQA request whose
prompt has the structures real attention shows: attention sinks (the first 4 keys), a planted
needle key, a relevant passage, a recency bias and random background; the observation window
(last 32 prompt queries) and the decode queries ask for the needle and the passage. Each
selector runs through :class:`kvsieve.Engine` and :class:`kvsieve.SparseAttention` (the
``vanilla`` golden backend, by name): a dense-or-evicting prefill, then ``decode_steps`` decode
steps. Recall is the share of the true (dense, uncompressed) attention probability of each decode
query, summed over the KV group and divided by the group size, that falls on the positions the
query really attends; averaged over decode steps and KV heads.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvsieve.metadata import KVCacheManager, KVCacheSpec
from kvsieve.selectors.oracle_topk.selector import attention_mass
from kvsieve.sparse import (Engine, SparseAttention, SparseAttentionConfig, get_selector_class, lower_budget, lower_config,
                            selection_mask)

__all__ = ["SyntheticInput", "RecallResult", "make_input", "run_selector", "selector_params", "recall_table"]


@dataclass(frozen=True)
class SyntheticInput:
    """Prompt ``q/k/v [L, H, D]`` and decode ``dq/dk/dv [S, H, D]`` (H = query or KV heads)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    needle: int
    passage: tuple[int, int]
    num_sinks: int

    @property
    def prompt_len(self) -> int:
        return self.k.shape[0]

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.k.shape[1]


@dataclass(frozen=True)
class RecallResult:
    """``recall`` and ``attended_fraction`` (attended / dense positions) averaged over decode
    steps and KV heads; ``selected[s][h]``: original prompt/decode positions attended at step ``s``."""

    recall: float
    attended_fraction: float
    selected: list[list[set[int]]]


def make_input(*, prompt_len: int = 2048, decode_steps: int = 4, num_kv_heads: int = 2, group_size: int = 4,
               head_dim: int = 64, seed: int = 0) -> SyntheticInput:
    """The seeded structured input described in the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    hkv, hq, d, n = num_kv_heads, num_kv_heads * group_size, head_dim, prompt_len

    def unit() -> torch.Tensor:  # one direction per KV head, norm sqrt(d) (so q.k/sqrt(d) ~ the weight)
        u = torch.randn(hkv, d, generator=gen)
        return u / u.norm(dim=-1, keepdim=True) * d ** 0.5

    sink, needle_dir, passage_dir, recent_dir = unit(), unit(), unit(), unit()
    q = torch.randn(n, hq, d, generator=gen) * 0.5
    k = torch.randn(n, hkv, d, generator=gen)
    v = torch.randn(n, hkv, d, generator=gen)
    needle, passage = int(0.37 * n), (int(0.7 * n), int(0.7 * n) + 64)
    k[:4] += 4.0 * sink
    k[needle] += 6.0 * needle_dir
    k[passage[0]: passage[1]] += 2.5 * passage_dir
    k[-128:] += 1.5 * recent_dir
    ask = (sink + needle_dir + passage_dir + recent_dir).repeat_interleave(group_size, dim=0) / d ** 0.5  # [Hq, D]
    q += (sink + recent_dir).repeat_interleave(group_size, dim=0) / d ** 0.5
    q[-32:] += ask - (sink + recent_dir).repeat_interleave(group_size, dim=0) / d ** 0.5
    s = decode_steps
    dq = torch.randn(s, hq, d, generator=gen) * 0.5 + ask
    dk = torch.randn(s, hkv, d, generator=gen) + 1.5 * recent_dir
    dv = torch.randn(s, hkv, d, generator=gen)
    return SyntheticInput(q, k, v, dq, dk, dv, needle, passage, 4)


def run_selector(name: str | None, params: dict, data: SyntheticInput, *, tokens_per_block: int = 16) -> RecallResult:
    """Prefill then decode ``data`` through a one-layer engine with selector ``name`` (``None`` = dense)."""
    n, hkv, d = data.prompt_len, data.k.shape[1], data.k.shape[2]
    steps = data.dq.shape[0]
    blocks = -(-(n + steps) // tokens_per_block)
    spec = KVCacheSpec(num_layers=1, num_blocks=blocks + 2, tokens_per_block=tokens_per_block, num_kv_heads=hkv,
                       head_dim=d, max_requests=1, max_blocks_per_seq=blocks)
    cache = KVCacheManager(spec)
    plan = lower_config(None if name is None else SparseAttentionConfig(name, params), num_layers=1)[0]
    layer = SparseAttention(layer_idx=0, num_q_heads=data.q.shape[1], num_kv_heads=hkv, head_dim=d, plan=plan,
                            backend="vanilla")
    engine = Engine(cache, [layer], max_num_requests=1, max_num_tokens=n)
    (prefill,) = engine.step([0], [n], 1, [(data.q, data.k, data.v)])
    p = prefill.params
    if p is not None and p.sparse_kv_indices is not None:
        origin = p.sparse_kv_indices.to(torch.int64)  # [Hkv, kept]: cache position -> prompt position
    else:
        origin = torch.arange(n).expand(hkv, n)
    all_k = torch.cat([data.k, data.dk])
    recalls, fractions, selected = [], [], []
    for s in range(steps):
        origin = torch.cat([origin, torch.full((hkv, 1), n + s)], dim=1)
        md = engine.begin_step([0], [1], 0)
        params = layer.forward(data.dq[s: s + 1], data.dk[s: s + 1], data.dv[s: s + 1], md).params
        engine.end_step()
        mask = selection_mask(params, slice(0, 1), md.token_kv_lens, origin.shape[1], hkv)[:, 0]
        mass = attention_mass(data.dq[s: s + 1], all_k[: n + s + 1], torch.tensor([n + s + 1]), d ** -0.5)[0]
        mass = mass / data.group_size  # [Hkv, n + s + 1], rows sum to 1
        picked = [origin[h][mask[h]] for h in range(hkv)]
        recalls += [float(mass[h, picked[h]].sum()) for h in range(hkv)]
        fractions += [picked[h].numel() / (n + s + 1) for h in range(hkv)]
        selected.append([set(picked[h].tolist()) for h in range(hkv)])
    return RecallResult(sum(recalls) / len(recalls), sum(fractions) / len(fractions), selected)


#: each selector's fixed settings: RocketKV keeps ``4 * budget`` prompt tokens in stage 1 (set in
#: :func:`selector_params`); block_select uses 16-token blocks so small budgets still hold several blocks
SETTINGS: dict[str, dict] = {"oracle_topk": {}, "streaming": {"num_sink": 4}, "snapkv": {}, "rocketkv": {},
                             "quest": {}, "block_select": {"block_size": 16}}


def selector_params(budget: int) -> dict[str, dict]:
    """Each selector's config at a budget of ``budget`` attended tokens per decode query, given to
    its declared budget knob by :func:`kvsieve.sparse.lower_budget` (RocketKV's pages, block_select's
    blocks)."""
    out = {}
    for name, params in SETTINGS.items():
        params = params | ({"prompt_budget": 4 * budget} if name == "rocketkv" else {})
        out[name] = params | lower_budget(get_selector_class(name), params, budget, tokens=budget).knob
    return out


def recall_table(budgets: tuple[int, ...] = (64, 128, 256, 512), *, seed: int = 0,
                 emit: Callable[[str], None] = print) -> dict[str, dict[int, RecallResult]]:
    """Measure every selector at every budget and ``emit`` a Markdown table per metric."""
    data = make_input(seed=seed)
    results: dict[str, dict[int, RecallResult]] = {}
    for budget in budgets:
        for name, params in selector_params(budget).items():
            results.setdefault(name, {})[budget] = run_selector(name, params, data)
    emit(f"prompt {data.prompt_len} tokens, {data.k.shape[1]} KV heads x {data.group_size} query heads, "
         f"head_dim {data.k.shape[2]}, {data.dq.shape[0]} decode steps, seed {seed}")
    for title, get in (("recall of the true attention mass", lambda r: f"{r.recall:.3f}"),
                       ("attended fraction of the context", lambda r: f"{r.attended_fraction:.3f}"),
                       ("needle attended (all steps, all heads)",
                        lambda r: "yes" if all(data.needle in h for st in r.selected for h in st) else "no")):
        emit("")
        emit(f"{title}:")
        emit("| selector | " + " | ".join(f"budget {b}" for b in budgets) + " |")
        emit("|---|" + "---|" * len(budgets))
        for name, row in results.items():
            emit(f"| {name} | " + " | ".join(get(row[b]) for b in budgets) + " |")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512])
    args = parser.parse_args()
    recall_table(tuple(args.budgets), seed=args.seed)


if __name__ == "__main__":
    main()
