"""What DSA's indexer is distilled from (:mod:`.distill`): per trained layer of one window its
attention-input hidden states and, for a few sampled query rows, the layer's dense causal
attention averaged over its query heads, each row scored against every key it sees. The window
is run once through the frozen model by the harness's capture
(:attr:`kvsieve.sparse.CalibrationContext.capture`); a capture can be kept on disk and reused
(:func:`cached_capture`) when the weights, tokens, layers and rows are the same.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...sparse.calibration import LayerCapture
from ...sparse.sparse_layers import sparse_layers

__all__ = ["WindowTargets", "cached_capture", "sample_rows", "trainable_layers", "window_targets"]


@dataclass(frozen=True)
class WindowTargets:
    """One window's training data: the sampled query ``rows [R]`` (ascending), per layer the
    attention-input ``hidden [S, hidden_size]`` (bf16) and ``p [R, S]`` (fp16; the causal dense
    attention of each sampled row, averaged over the query heads; 0 past the row)."""

    rows: torch.Tensor
    hidden: dict[int, torch.Tensor]
    p: dict[int, torch.Tensor]

    @property
    def seq_len(self) -> int:
        """The window's length ``S``."""
        return next(iter(self.p.values())).shape[1]


def trainable_layers(model_config: Any, layers: list[int] | None) -> list[int]:
    """``layers`` (default: the full-attention layers) after refusing any sliding-window layer:
    the targets are full causal attention."""
    cfg = getattr(model_config, "text_config", model_config)
    types = getattr(cfg, "layer_types", None)
    chosen = sorted(sparse_layers(num_layers=cfg.num_hidden_layers, model_layer_types=types, layers=layers,
                                  layer_types=None, dense_layers=[]))
    sliding = [i for i in chosen if types is not None and types[i] != "full_attention"]
    if sliding:
        raise ValueError(f"distill: layers {sliding} are {sorted({types[i] for i in sliding})} layers; the indexer "
                         "is distilled from full causal attention only")
    return chosen


def sample_rows(seq_len: int, rows: int, gen: torch.Generator, tail: int = 1) -> torch.Tensor:
    """``rows`` distinct positions (int64, ascending): the last ``tail`` (>= 1) positions of the
    window and the others drawn from its last 7/8 before them."""
    if tail < 1:
        raise ValueError(f"sample_rows: tail must be >= 1 (the last position is always sampled), got {tail}")
    if tail > rows:
        raise ValueError(f"sample_rows: the window's last {tail} rows must all be sampled, but only {rows} rows are")
    lo = min(seq_len // 8, seq_len - rows)
    pick = torch.randperm(seq_len - tail - lo, generator=gen)[: rows - tail] + lo
    return torch.cat([pick, torch.arange(seq_len - tail, seq_len)]).sort().values


def window_targets(caps: dict[int, LayerCapture], rows: torch.Tensor) -> WindowTargets:
    """The targets of ``rows`` (:class:`WindowTargets`) from one window's captured layers."""
    return WindowTargets(rows, {i: c.hidden for i, c in caps.items()},
                         {i: c.dense_attention(rows).mean(1).half() for i, c in caps.items()})


def cached_capture(path: Path | None, key: dict[str, Any], capture: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``key | capture()``, kept in the file ``path`` and read back from there instead when the
    file holds the same ``key`` (strings compared as strings, anything else as tensors). The
    captures are the expensive part of a run: a run stopped midway keeps the windows it finished."""
    def same(a: Any, b: Any) -> bool:
        return a == b if isinstance(b, str) else torch.equal(torch.as_tensor(a), torch.as_tensor(b))

    if path is not None and path.is_file():
        saved = torch.load(path, weights_only=True)
        if all(k in saved and same(saved[k], v) for k, v in key.items()):
            return saved
    out = key | capture()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(out, tmp)
        tmp.replace(path)
    return out
