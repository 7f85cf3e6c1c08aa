"""The step bookkeeping of a :class:`~kvsieve.integrations.transformers.KvsieveSession`: opening a
kvsieve step around one model forward (new requests or the live ones, the prefix cache, the beam
width), closing it, undoing it when the forward fails, and rewinding the live requests. Kept apart
from the session's construction and layer calls; the session inherits it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ...sparse import Engine

__all__ = ["SessionSteps"]


class SessionSteps:
    """Step methods of a session; the session sets the attributes they use (``engine``, ``model``,
    ``device``, ``max_batch``, ``max_tokens``, ``prefix_caching``, ``beam_width`` and the step state)."""

    engine: Engine
    max_tokens: int

    def rewind(self, length: int) -> None:
        """Drop every position ``>= length`` of the live requests (e.g. to reuse a prompt's cache
        for another selector that keeps no state of its own). Not valid after eviction."""
        if not 0 <= length <= self._next_pos:
            raise ValueError(f"length must be in [0, {self._next_pos}], got {length}")
        for rid in self._request_ids:
            for cache, window in zip(self.engine.caches, self.engine.windows):
                if cache.valid_len(rid) != self._next_pos:
                    raise ValueError(f"rewind: request {rid} was compacted by eviction; prefill again instead")
                p, s = cache.tokens_per_block, cache.slot(rid)
                if window is not None and not cache.block_table[s, max(length + 1 - window, 0) // p: -(-length // p)].all():
                    raise ValueError(f"rewind: the sliding-window layers of request {rid} dropped positions the window "
                                     f"at length {length} reads; prefill again, or build the session with "
                                     "release_windows=False")
        for rid in self._request_ids:
            self.engine.truncate(rid, length)
        self._next_pos = length

    @torch.inference_mode()
    def tile_context(self, length: int) -> None:
        """Grow every live request from its cached positions to ``length`` by repeating its blocks
        block for block (K/V and every auxiliary pool, e.g. Quest's page summaries), without running
        the model: a context of that length for timing, without its prefill. The positions past the
        prefill hold copies, not what the model would compute there (speed only). Refused, naming
        the reason, and nothing changes: a step open, no live requests, a length below the cached
        positions, cached positions that are not whole blocks, several cache groups (sliding-window
        layers), a request compacted by eviction or tracked for prefix caching."""
        if self._step_open:
            raise RuntimeError("tile_context: a step is open")
        if not self._request_ids:
            raise RuntimeError("tile_context: no live requests (prefill first)")
        have, caches = self._next_pos, self.engine.caches
        if len(caches) != 1:
            raise ValueError(f"tile_context: the session has {len(caches)} cache groups (sliding-window layers); "
                             "tiling one group's blocks would leave the others short")
        cache = caches[0]
        if not have <= length <= self.max_tokens:
            raise ValueError(f"tile_context: length must be in [{have} (the cached positions), "
                             f"{self.max_tokens} (max_tokens)], got {length}")
        if have == 0 or have % cache.tokens_per_block:
            raise ValueError(f"tile_context: the {have} cached positions are not whole blocks of "
                             f"{cache.tokens_per_block}")
        if self._tracked:
            raise ValueError("tile_context: the requests are tracked for prefix caching (their positions must hold "
                             "their tokens)")
        for rid in self._request_ids:
            if cache.valid_len(rid) != have:
                raise ValueError(f"tile_context: request {rid} was compacted by eviction")
        cache.check_appends([(rid, length - have) for rid in self._request_ids])
        for rid in self._request_ids:
            src = cache.block_ids(rid)
            cache.append_tokens(rid, length - have)
            dst = torch.tensor(cache.block_ids(rid)[len(src):], dtype=torch.long)
            src_t = torch.tensor([src[j % len(src)] for j in range(len(dst))], dtype=torch.long)
            for pools in (cache.pools, *cache.aux_pools.values()):
                for pool in pools:
                    pool[dst] = pool[src_t]
        self._next_pos = length

    def _run(self, ids: torch.Tensor, *, new_requests: bool) -> torch.Tensor:
        return self.run_logits(ids, new_requests=new_requests)[:, -1]

    @torch.inference_mode()
    def run_logits(self, ids: torch.Tensor, *, new_requests: bool, keep: int = 1, dense: bool = False) -> torch.Tensor:
        """One session-driven step of ``ids [B, S]`` (new requests, or appended to the live ones);
        returns the logits of its last ``keep`` positions ``[B, keep, V]``. ``dense``: every layer
        attends densely, its selector keeping its state (``Engine.begin_step(..., dense=True)``)."""
        b, s = ids.shape
        reused = self._open_step(b, s, new_requests, ids, dense=dense)
        start = self._next_pos - s + reused
        self._driven = True
        try:
            pos = torch.arange(start, self._next_pos, device=self.device).expand(b, s - reused)
            logits = self.model(input_ids=ids[:, reused:].to(self.device), position_ids=pos, use_cache=False,
                                logits_to_keep=keep).logits
        except BaseException:
            self._abort_step(s, new_requests)
            raise
        finally:
            self._driven = False
        self._close_step()
        return logits

    def _open_step(self, batch: int, num_new: int, new_requests: bool, ids: torch.Tensor | None = None,
                   dense: bool = False) -> int:
        """Open the step of ``num_new`` positions per row (token ids ``ids [batch, num_new]`` when
        the session drives; ``dense``: see :meth:`run_logits`); returns how many leading positions of
        new prompts came from the prefix cache (the model runs on the rest)."""
        if self.max_batch is not None and batch > self.max_batch:
            raise ValueError(f"batch of {batch} rows exceeds max_batch={self.max_batch}")
        if num_new > self.max_tokens:  # refused by the user's knob, before anything changes
            raise ValueError(f"{'a prompt' if new_requests else 'a step'} of {num_new} tokens per row exceeds "
                             f"max_tokens={self.max_tokens}, the per-request capacity of the session's paged cache "
                             "(kvsieve.apply(..., max_tokens=...) or KvsieveSession(max_tokens=...)); the session "
                             "is unchanged")
        reused = 0
        if new_requests:
            for rid in self.engine.request_ids:
                self.engine.free(rid)
            if batch > self._rows_capacity:
                self._size_cache(batch)
            self._request_ids = list(range(batch))
            self._next_pos = 0
            self._tracked = self.prefix_caching and ids is not None
            if self._tracked:
                reused = self._add_prompts(ids)
        elif batch != len(self._request_ids):
            raise ValueError(f"a step of {batch} rows for {len(self._request_ids)} live requests")
        tokens = ids[:, reused:].tolist() if self._tracked else None
        try:
            self.engine.begin_step(self._request_ids, [num_new - reused] * batch,
                                   num_contexts=batch if new_requests else 0, tokens=tokens, beam_width=self.beam_width,
                                   dense=dense)
        except BaseException:
            if new_requests:
                self._drop_new_requests()
            raise
        self._phase = "context" if new_requests else "generation"
        self._next_pos += num_new
        self._step_open = True
        return reused

    def _add_prompts(self, ids: torch.Tensor) -> int:
        """Add the new rows with their prompts' token ids; each holds its longest cached prefix,
        cut to the shortest of the batch (rows run as one equal-length step). Returns its length."""
        try:
            reused = [self.engine.add_request(rid, row) for rid, row in zip(self._request_ids, ids.tolist())]
            for rid, n in zip(self._request_ids, reused):
                if n > min(reused):
                    self.engine.truncate(rid, min(reused))
        except BaseException:
            self._drop_new_requests()
            raise
        return min(reused)

    def _drop_new_requests(self) -> None:
        """A prefill that failed leaves no live requests (nor their holds on cached blocks)."""
        for rid in self.engine.request_ids:
            self.engine.free(rid)
        self._request_ids = []
        self._tracked = False

    def _close_step(self) -> None:
        self.engine.end_step()
        self._step_open = False

    def _abort_step(self, num_new: int, new_requests: bool) -> None:
        """A forward failed inside the step: the cache goes back to before it (``Engine.abort_step``);
        a failed prefill leaves no live requests."""
        self.engine.abort_step()
        self._step_open = False
        self._next_pos -= num_new
        if new_requests:
            self._drop_new_requests()
