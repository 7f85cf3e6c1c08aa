"""How much SnapKV's definition variants move the kept set: the Jaccard index, per KV head and
averaged, between the prompt tokens kept by each variant of the ``snapkv`` options and by the
option set equal to NVIDIA kvpress's ``SnapKVPress``, on the seeded structured input of
tools/recall_table.py (sinks, a needle, a passage, a recency bias).

Run ``python tools/snapkv_variants.py``.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

from recall_table import make_input, run_selector

__all__ = ["KVPRESS", "VARIANTS", "jaccard", "variant_table"]

KVPRESS = {"window_size": 64, "kernel_size": 5, "pooling": "avg", "softmax_over": "all", "group_sum": "after_pool"}
VARIANTS: dict[str, dict] = {
    "kvpress SnapKVPress": {},
    "window 32": {"window_size": 32},
    "kernel 7": {"kernel_size": 7},
    "max pooling": {"pooling": "max"},
    "softmax over the prefix": {"softmax_over": "prefix"},
    "max pooling, group summed before": {"pooling": "max", "group_sum": "before_pool"},
    "snapkv defaults (w32 k7 max, all, after)": {"window_size": 32, "kernel_size": 7, "pooling": "max"},
    "rocketkv stage 1 (w32 k7 max, prefix, before)": {"window_size": 32, "kernel_size": 7, "pooling": "max",
                                                      "softmax_over": "prefix", "group_sum": "before_pool"},
}


def jaccard(a: list[set[int]], b: list[set[int]]) -> float:
    """Mean over heads of ``|a_h & b_h| / |a_h | b_h|`` (two empty sets count 1)."""
    return sum(len(x & y) / len(x | y) if x | y else 1.0 for x, y in zip(a, b)) / len(a)


def variant_table(budgets: tuple[int, ...] = (512, 128), *, seed: int = 0,
                  emit: Callable[[str], None] = print) -> dict[str, dict[int, float]]:
    """Jaccard of each variant against the kvpress option set at each ``prompt_budget``; ``emit``
    a Markdown table."""
    data = make_input(seed=seed, decode_steps=1)
    n = data.prompt_len

    def kept(options: dict, budget: int) -> list[set[int]]:
        first_step = run_selector("snapkv", KVPRESS | options | {"prompt_budget": budget}, data).selected[0]
        return [{p for p in heads if p < n} for heads in first_step]

    table = {name: {} for name in VARIANTS}
    for budget in budgets:
        ref = kept({}, budget)
        for name, options in VARIANTS.items():
            table[name][budget] = jaccard(kept(options, budget), ref)
    emit(f"prompt {n} tokens, {data.k.shape[1]} KV heads x {data.group_size} query heads, seed {seed}; "
         "Jaccard of the kept prompt tokens against the kvpress option set")
    emit("| variant | " + " | ".join(f"budget {b} ({b / n:.4g} of the prompt)" for b in budgets) + " |")
    emit("|---|" + "---|" * len(budgets))
    for name, row in table.items():
        emit(f"| {name} | " + " | ".join(f"{row[b]:.2f}" for b in budgets) + " |")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 128])
    args = parser.parse_args()
    variant_table(tuple(args.budgets), seed=args.seed)


if __name__ == "__main__":
    main()
