"""kvsieve's drafter for vLLM's own speculative decoding (docs/lossless.md, "In vLLM"):

    speculative_config={"method": "custom_class", "model": "kvsieve.integrations.vllm.drafter.SparseDrafter",
                        "num_speculative_tokens": K}

vLLM builds :class:`SparseDrafter` in each worker (``Class(vllm_config)``), hands it the target
model (``load_model``; kept under a private name) and, after each step's sampling, calls
:meth:`SparseDrafter.propose`. The drafter runs the target model's own layers over vLLM's own paged
cache, ``K`` one-token steps with every drafting request batched, its attention layers served by the
plug-in's selector (:data:`.draft_steps.DRAFT_STEP`); it proposes the argmax of each step's logits.
vLLM then verifies the drafts in its next step (rows of ``K + 1`` tokens, vLLM's own dense attention,
:data:`.draft_steps.OWN_STEP`) with its rejection sampler: no second copy of the weights, no second
cache, no second prefill.

A draft step's K/V go where the token's K/V would go: the slots of the request's own blocks (each
row's slot from the block table of the step just run), which the verify pass overwrites with the
dense K/V. vLLM allocates no look-ahead slots for a ``custom_class`` proposer, so each request drafts
at most what its blocks already hold (:func:`draft_counts`); a request whose next position starts a
block vLLM has not allocated drafts nothing that step.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .config import read_plugin_config
from .draft_checks import refuse_without_plugin
from .draft_steps import drafting, recorded

__all__ = ["SparseDrafter", "DraftRows", "draft_counts", "draft_slots"]


@dataclass(frozen=True)
class DraftRows:
    """The requests that draft this step: ``rows`` int64 ``[R]`` (their rows of vLLM's batch),
    ``tokens`` int64 ``[R]`` (each one's last sampled token), ``positions`` int64 ``[R]`` (that
    token's position, the first draft step's), ``counts`` int64 ``[R]`` (drafts each proposes, >= 1)."""

    rows: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray
    counts: np.ndarray


def draft_counts(sampled: Sequence[Sequence[int]], num_tokens: np.ndarray, seq_lens: Sequence[np.ndarray],
                 block_sizes: Sequence[int], *, k: int, max_model_len: int) -> DraftRows:
    """Which rows draft and how many tokens each. ``sampled``: each row's tokens sampled this step
    (empty: a prompt chunk, or a discarded row); ``num_tokens`` int ``[B]``: each row's tokens with
    those (vLLM's ``num_tokens_no_spec``); ``seq_lens``: per KV cache group, int ``[B]``, the tokens
    the step just run held in the cache (its blocks cover at least ``ceil(seq_len / block) * block``
    positions), ``block_sizes`` the groups' block sizes. A row drafts ``min(k, covered - position,
    max_model_len - num_tokens)`` tokens (the verify pass needs ``count + 1`` positions under
    ``max_model_len``)."""
    b = len(sampled)
    last = np.array([s[-1] if len(s) else -1 for s in sampled], dtype=np.int64)
    pos = num_tokens[:b].astype(np.int64) - 1
    covered = np.min([-(-np.asarray(s[:b], dtype=np.int64) // bs) * bs for s, bs in zip(seq_lens, block_sizes)],
                     axis=0)
    counts = np.minimum(np.minimum(covered - pos, max_model_len - 1 - pos), k)
    counts[last < 0] = 0
    rows = np.flatnonzero(counts > 0)
    return DraftRows(rows, last[rows], pos[rows], counts[rows])


def draft_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 ``[R]``: the cache slot of each draft row's position. ``block_table`` ``[R, W]`` (the
    rows' physical blocks), ``positions`` int64 ``[R]``."""
    blocks = block_table.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1).to(torch.int64)
    return blocks * block_size + positions % block_size


class SparseDrafter:
    """vLLM's ``custom_class`` proposer (module docstring). Refuses, when built, a process whose
    plug-in is off (:func:`.draft_checks.refuse_without_plugin`); the plug-in's first layer refuses
    what the drafter does not serve exactly (:func:`.draft_checks.check_speculation`)."""

    def __init__(self, vllm_config: Any) -> None:
        refuse_without_plugin(read_plugin_config(additional=getattr(vllm_config, "additional_config", None)))
        self.vllm_config = vllm_config
        self.num_drafts = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self._target: torch.nn.Module | None = None

    def load_model(self, target: torch.nn.Module) -> None:
        """vLLM's CPU runner hands the target model (the drafter's layers are the target's)."""
        self._target = target

    @torch.inference_mode()
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings: object = None) -> list[list[int]]:
        """Each row's drafts (vLLM's batch order; ``[]``: none this step). ``sampled_token_ids``: each
        row's tokens sampled this step; ``num_tokens_no_spec`` int ``[max_num_reqs]``: each row's
        tokens with those; ``token_ids_cpu`` and ``slot_mappings`` (vLLM's other arguments) are not
        read: the last sampled token is the first draft step's input, and the slots are the draft
        positions' (:func:`draft_slots`)."""
        records = recorded()
        b = len(sampled_token_ids)
        drafts: list[list[int]] = [[] for _ in range(b)]
        if b == 0 or not records:
            return drafts
        for _, common in records:
            if common.num_reqs != b:
                raise RuntimeError(f"kvsieve drafter: the last step's attention metadata has {common.num_reqs} rows, "
                                   f"vLLM sampled {b}")
        todo = draft_counts(sampled_token_ids, num_tokens_no_spec, [c.seq_lens.cpu().numpy() for _, c in records],
                            [builder.block_size for builder, _ in records], k=self.num_drafts,
                            max_model_len=self.max_model_len)
        rows, positions = torch.from_numpy(todo.rows), torch.from_numpy(todo.positions)
        current = torch.from_numpy(todo.tokens.copy())  # each drafting row's input of the next step
        for j in range(int(todo.counts.max(initial=0))):
            live = torch.from_numpy(todo.counts > j)
            with drafting(first=j == 0):
                current[live] = self._step(records, rows[live], current[live], positions[live] + j)
            for r, t in zip(rows[live].tolist(), current[live].tolist()):
                drafts[r].append(t)
        return drafts

    def _step(self, records: list[tuple[Any, Any]], rows: torch.Tensor, tokens: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
        """One draft step: ``tokens`` int64 ``[R]`` at ``positions`` int64 ``[R]`` of the batch rows
        ``rows`` int64 ``[R]`` -> the next token of each, int64 ``[R]`` (the argmax of the target's
        logits, the attention layers served by the plug-in's selector)."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        n = int(rows.numel())
        starts = torch.arange(n + 1, dtype=torch.int32)
        seq_lens = (positions + 1).to(torch.int32)
        attn: dict[str, Any] = {}
        slots: dict[str, torch.Tensor] = {}
        for builder, common in records:
            table = common.block_table_tensor[rows]
            slot = draft_slots(table, positions, builder.block_size)
            step = CommonAttentionMetadata(
                query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=seq_lens, num_reqs=n,
                num_actual_tokens=n, max_query_len=1, max_seq_len=int(seq_lens.max()), block_table_tensor=table,
                slot_mapping=slot, causal=True)
            md = builder.build(0, step)
            for name in builder.layer_names:
                attn[name], slots[name] = md, slot
        with set_forward_context(attn, self.vllm_config, num_tokens=n, slot_mapping=slots):
            hidden = self._target(input_ids=tokens.to(torch.int32), positions=positions)
            logits = self._target.compute_logits(hidden)
        return logits.argmax(dim=-1).to(torch.int64)
