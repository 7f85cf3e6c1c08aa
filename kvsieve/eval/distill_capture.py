"""What DSA's indexer is distilled from (:mod:`.distill_indexer`): one window of text run once
through the frozen model, and per trained layer its attention-input hidden states and, for a few
sampled query rows, the layer's dense causal attention (averaged over its query heads), each row
scored against every key it sees. Captured through the model's own attention interface, so RoPE,
norms and the model's scale are the model's; a capture can be kept on disk and reused
(:func:`cached_capture`) when the weights, tokens, layers and rows are the same.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["LayerCapture", "WindowTargets", "cached_capture", "capture_attention", "capture_targets",
           "release_free_heap", "sample_rows", "trainable_layers", "windowed_attention"]

_CAPTURE = "kvsieve_distill_capture"


@dataclass(frozen=True)
class WindowTargets:
    """One window's training data: the sampled query ``rows [R]`` (ascending), per layer the
    attention-input ``hidden [S, hidden_size]`` (bf16) and ``p [R, S]`` (fp16; the causal dense
    attention of each sampled row, averaged over the query heads; 0 past the row)."""

    rows: torch.Tensor
    hidden: dict[int, torch.Tensor]
    p: dict[int, torch.Tensor]


def trainable_layers(model_config: Any, layers: list[int] | None) -> list[int]:
    """``layers`` (default: the full-attention layers) after refusing any sliding-window layer:
    the targets are full causal attention."""
    from ..sparse.sparse_layers import sparse_layers

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


@dataclass(frozen=True)
class LayerCapture:
    """One layer of one window as its attention receives it: the attention-input ``hidden [S,
    hidden_size]`` (bf16), the queries of the chosen ``rows`` ``q [R, Hq, D]`` and every key
    ``k [S, Hkv, D]`` (fp32, RoPE and any norm applied) and the softmax ``scale``."""

    hidden: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    scale: float

    def dense_attention(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 ``[R, Hq, S]``: the causal softmax of each row's query heads over the keys."""
        k = self.k.repeat_interleave(self.q.shape[1] // self.k.shape[1], 1)
        s = torch.einsum("rhd,shd->rhs", self.q, k) * self.scale
        return torch.softmax(s.masked_fill((torch.arange(k.shape[0]) > rows[:, None])[:, None], float("-inf")), -1)


def windowed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int,
                       scaling: float | None) -> torch.Tensor:
    """Causal sliding-window attention of one sequence, in query chunks of ``window`` rows that each
    read only the ``2 * window - 1`` keys they can see: ``query [1, Hq, S, D]``, ``key``/``value
    [1, Hkv, S, D]`` -> ``[1, S, Hq, D]`` (the layout transformers' attention functions return).
    Position ``t`` attends ``s`` with ``t - window < s <= t`` (transformers' sliding mask); the cost
    is ``O(S * window)`` instead of the masked full ``O(S**2)``."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    s = query.shape[2]
    out = torch.empty_like(query)
    for c0 in range(0, s, window):
        c1, k0 = min(s, c0 + window), max(0, c0 - window + 1)
        qpos, kpos = torch.arange(c0, c1)[:, None], torch.arange(k0, c1)[None]
        mask = (kpos <= qpos) & (kpos > qpos - window)
        out[:, :, c0:c1] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, c0:c1], key[:, :, k0:c1], value[:, :, k0:c1], attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()


def capture_attention(model: torch.nn.Module, ids: torch.Tensor, layers: list[int], rows: torch.Tensor
                      ) -> dict[int, LayerCapture]:
    """Run the frozen model once over ``ids [1, S]``; per layer of ``layers`` its
    :class:`LayerCapture` at query ``rows``. Refuses a layer whose attention is not plain causal
    softmax (logit soft-capping, a sliding window). The other sliding-window layers run
    :func:`windowed_attention`. The forward pass's freed C heap goes back to the OS before
    returning (:func:`release_free_heap`), so that repeated captures stay at what they keep."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    hidden: dict[int, torch.Tensor] = {}
    found: dict[int, LayerCapture] = {}
    wanted = set(layers)

    def capture(module, query, key, value, attention_mask, **kwargs):
        i = getattr(module, "layer_idx", None)
        if i not in wanted and kwargs.get("sliding_window") and kwargs.get("softcap") is None:
            return windowed_attention(query, key, value, kwargs["sliding_window"], kwargs.get("scaling")), None
        if i in wanted:
            for name in ("softcap", "sliding_window"):
                if kwargs.get(name) is not None:
                    raise ValueError(f"distill: layer {i} attention has {name}={kwargs[name]}; only plain causal "
                                     "softmax attention is distilled")
            scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
            found[i] = LayerCapture(hidden[i], query[0][:, rows].transpose(0, 1).float(),
                                    key[0].transpose(0, 1).float(), float(scale))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def pre(mod, args, kwargs):
        hidden[mod.layer_idx] = kwargs["hidden_states"][0].detach().bfloat16()

    attns = [layer.self_attn for layer in model.get_decoder().layers]
    hooks = [attns[i].register_forward_pre_hook(pre, with_kwargs=True) for i in layers]
    AttentionInterface.register(_CAPTURE, capture)
    AttentionMaskInterface.register(_CAPTURE, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_CAPTURE)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
        for h in hooks:
            h.remove()
    release_free_heap()
    return {i: found[i] for i in layers}


def capture_targets(model: torch.nn.Module, ids: torch.Tensor, layers: list[int], rows: torch.Tensor) -> WindowTargets:
    """Run the frozen model once over ``ids [1, S]`` and keep, for ``layers``, the targets of
    ``rows`` (:class:`WindowTargets`)."""
    caps = capture_attention(model, ids, layers, rows)
    return WindowTargets(rows, {i: c.hidden for i, c in caps.items()},
                         {i: c.dense_attention(rows).mean(1).half() for i, c in caps.items()})


def release_free_heap() -> bool:
    """Hand the C heap's free memory back to the OS (glibc's ``malloc_trim``); False where the C
    library has none. A capture's forward pass frees far more than it keeps, and glibc keeps what
    is freed: on SmolLM2 at 2K each capture left about 0.3 GB resident where 86 MB is kept, 9.3 GB
    after 25 windows (docs/results/dsa.md, section 8.1); trimmed, each adds what it keeps."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


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
