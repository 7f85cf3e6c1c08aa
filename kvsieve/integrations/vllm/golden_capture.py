"""A debug aid for tests (``KVSIEVE_CAPTURE=/dir``): every layer call the selector path runs is also
computed by kvsieve's Vanilla golden on the same selection, and one JSON line per call is appended
to ``/dir/capture-<pid>.jsonl``: layer, tokens, contexts, attended and dense positions, the largest
difference to the golden, each phase's path, and, where the caller passes the host engine's own
attention of a dense call, the largest difference to it; the worker's ranks and the layer's head
counts on this worker. While it is on, every call takes the selector path (no one-call decode), so
every call is compared."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ...metadata import AttentionMetadata
from ...sparse import AttentionGeometry, LayerPlan, SparseRuntimeParams
from ...sparse.backends import AttentionResult, VanillaBackend
from .config import WorkerRanks

__all__ = ["GoldenCapture"]


class GoldenCapture:
    """One per layer runner: ``capture_dir`` the folder, ``ranks`` the worker."""

    def __init__(self, capture_dir: Path, ranks: WorkerRanks) -> None:
        self.capture_dir, self.ranks = capture_dir, ranks
        self.golden = VanillaBackend()

    def record(self, layer_idx: int, geometry: AttentionGeometry, plan: LayerPlan | None, q: torch.Tensor,
               md: AttentionMetadata, params: SparseRuntimeParams | None, res: AttentionResult,
               host_output: torch.Tensor | None) -> None:
        """q ``[T, Hq, D]`` (kvsieve order), ``res`` what the layer returned for it, ``host_output
        [T, Hq, D]`` the host's own attention of the step (kvsieve order) or ``None``."""
        ref, out = self.golden.forward(q, md, layer_idx, geometry, params).out, res.out
        attended = self.golden.effective_attended_tokens(params, md, geometry)
        record = {
            "layer": layer_idx, "num_tokens": md.num_tokens, "num_contexts": md.num_contexts,
            "tp_rank": self.ranks.tp_rank, "pp_rank": self.ranks.pp_rank,
            "num_q_heads": geometry.num_q_heads, "num_kv_heads": geometry.num_kv_heads,
            "selector": None if plan is None else plan.selector.name,
            "sparse": params is not None and params.sparse_attn_indices is not None,
            "attended": int(attended.sum()), "dense": int(md.token_kv_lens.to(torch.int64).sum()) * geometry.num_kv_heads,
            "max_abs_diff": float((out.float() - ref.float()).abs().max()) if out.numel() else 0.0,
            "ref_max_abs": float(ref.float().abs().max()) if ref.numel() else 0.0, "dtype": str(q.dtype),
            "paths": res.paths,
            "host_max_abs_diff": None if host_output is None or params is not None or not out.numel()
            else float((out.float() - host_output.float()).abs().max()),
        }
        self.capture_dir.mkdir(parents=True, exist_ok=True)
        with open(self.capture_dir / f"capture-{os.getpid()}.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
