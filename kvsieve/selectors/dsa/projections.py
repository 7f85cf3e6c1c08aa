"""The DSA lightning-indexer projections and the per-step inputs the ``dsa`` selector receives.

Besides q, k, v the indexer needs the layer's hidden state (and, in DeepSeek-V3.2, the low-rank
query). The caller therefore passes an :class:`IndexerInputs` with every step of the layer
(``SparseAttention.forward(..., model_inputs=IndexerInputs(...))``), either

* raw hidden states (``hidden``, optional ``q_input``, optional RoPE ``cos``/``sin``), which the
  selector's :class:`IndexerProjections` of that layer turn into index queries/keys/weights, or
* the finished index tensors (``q_index``, ``k_index``, ``weights``) from a model that computes
  its own indexer.

Math (DeepSeek-V3.2): ``q_I = wq(q_input) [T, H, D]``, ``k_I = LayerNorm(wk(hidden)) [T, D]`` (one
key shared by the heads), ``w = weights_proj(hidden) * D**-0.5 * H**-0.5`` in fp32; RoPE on the
first ``rope_dim`` channels of q_I and k_I, neox (half split) or interleaved (pairs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["IndexerInputs", "IndexerProjections", "apply_rope", "rope_cos_sin", "save_projections",
           "load_projections", "projections_geometry"]


@dataclass
class IndexerInputs:
    """One layer's indexer inputs for one step (``T`` = the step's tokens, metadata order).

    Either ``hidden [T, hidden_size]`` (+ ``q_input [T, q_input_size]``, default ``hidden``; +
    ``cos``/``sin [T, rope_dim]`` to override the selector's default RoPE, e.g. YaRN) or the
    finished ``q_index [T, H, D]`` / ``k_index [T, D]`` (RoPE applied) / ``weights [T, H]`` fp32
    (``D**-0.5 * H**-0.5`` folded in)."""

    hidden: torch.Tensor | None = None
    q_input: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    q_index: torch.Tensor | None = None
    k_index: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        finished = [x is not None for x in (self.q_index, self.k_index, self.weights)]
        if any(finished) and not all(finished):
            raise ValueError("IndexerInputs: q_index, k_index and weights must be given together")
        if all(finished) == (self.hidden is not None):
            raise ValueError("IndexerInputs: give either hidden (projections run in the selector) or "
                             "q_index/k_index/weights (finished indexer tensors), not both or neither")
        if (self.cos is None) != (self.sin is None):
            raise ValueError("IndexerInputs: cos and sin must be given together")

    @property
    def is_finished(self) -> bool:
        return self.q_index is not None


FORMAT = "kvsieve-dsa-indexer-v1"  # what save_projections writes and the readers check


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin [T, rope_dim]`` of the default RoPE (``cat(freqs, freqs)`` layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device) / rope_dim))
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate ``x [T, ..., rope_dim]`` with ``cos/sin [T, rope_dim]``. Neox rotates the halves;
    interleaved rotates pairs ``(x0, x1), (x2, x3), ...`` and returns them de-interleaved (the
    dot products, all the indexer uses, are the same as in the interleaved layout)."""
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if interleave:
        half = x.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class IndexerProjections(nn.Module):
    """Index projections of one layer (see the module docstring for the math)."""

    def __init__(self, hidden_size: int, n_heads: int, head_dim: int, rope_dim: int, *,
                 q_input_size: int | None = None, rope_theta: float = 10000.0, rope_interleave: bool = False,
                 k_norm: bool = True) -> None:
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("n_heads", n_heads), ("head_dim", head_dim)):
            if v < 1:
                raise ValueError(f"IndexerProjections.{name}: expected >= 1, got {v}")
        if not 0 <= rope_dim <= head_dim or rope_dim % 2:
            raise ValueError(f"IndexerProjections.rope_dim: expected an even value in [0, head_dim={head_dim}], "
                             f"got {rope_dim}")
        self.hidden_size, self.n_heads, self.head_dim, self.rope_dim = hidden_size, n_heads, head_dim, rope_dim
        self.q_input_size = q_input_size or hidden_size
        self.rope_theta, self.rope_interleave = rope_theta, rope_interleave
        self.wq = nn.Linear(self.q_input_size, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6) if k_norm else nn.Identity()
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)

    def geometry(self) -> dict:
        """Constructor arguments (saved with the weights)."""
        return dict(hidden_size=self.hidden_size, n_heads=self.n_heads, head_dim=self.head_dim,
                    rope_dim=self.rope_dim, q_input_size=self.q_input_size, rope_theta=self.rope_theta,
                    rope_interleave=self.rope_interleave, k_norm=isinstance(self.k_norm, nn.LayerNorm))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor | None,
              sin: torch.Tensor | None) -> torch.Tensor:
        if not self.rope_dim:
            return x
        if cos is None:
            cos, sin = rope_cos_sin(positions, self.rope_dim, self.rope_theta)
        r = self.rope_dim
        return torch.cat([apply_rope(x[..., :r], cos.float(), sin.float(), self.rope_interleave), x[..., r:]], -1)

    def queries(self, hidden: torch.Tensor, positions: torch.Tensor, q_input: torch.Tensor | None = None,
                cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_I [T, H, D], w [T, H])`` fp32 of the query tokens (RoPE applied, ``w`` scaled)."""
        dt = self.wk.weight.dtype
        q_in = hidden if q_input is None else q_input
        q = self.wq(q_in.to(dt)).float().view(-1, self.n_heads, self.head_dim)
        w = self.weights_proj(hidden.to(dt)).float() * self.weight_scale
        return self._rope(q, positions, cos, sin), w

    def keys(self, hidden: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor | None = None,
             sin: torch.Tensor | None = None, *, stacked: torch.Tensor | None = None) -> torch.Tensor:
        """``k_I [T, D]`` fp32 of the cached tokens (key norm and RoPE applied); ``stacked``: this
        module's :meth:`stacked_weight`, whose key rows then project (the matmul :meth:`forward` runs
        with it, so the two agree bit for bit)."""
        self._check_stacked(stacked, None, ".keys")
        x = hidden.to(self.wk.weight.dtype)
        k = self.wk(x) if stacked is None else nn.functional.linear(x, stacked[self.n_heads * (self.head_dim + 1):])
        return self._rope(self.k_norm(k).float(), positions, cos, sin)

    def _check_stacked(self, stacked: torch.Tensor | None, q_input: torch.Tensor | None, where: str) -> None:
        """Refuse a ``stacked`` weight (when given) of another shape than :meth:`stacked_weight`'s or
        given with ``q_input``, naming the caller (``where``)."""
        h, d = self.n_heads, self.head_dim
        if stacked is not None and (q_input is not None or stacked.shape != (h * d + h + d, self.hidden_size)):
            raise ValueError(f"IndexerProjections{where}: stacked must be [{h * d + h + d}, {self.hidden_size}] "
                             f"(stacked_weight()) and comes without q_input; got {tuple(stacked.shape)}"
                             f"{' with q_input' if q_input is not None else ''}")

    @property
    def weight_scale(self) -> float:
        """The factor of the weights, ``head_dim**-0.5 * n_heads**-0.5``."""
        return self.head_dim ** -0.5 * self.n_heads ** -0.5

    def stacked_weight(self) -> torch.Tensor | None:
        """``[H*D + H + D, hidden_size]``: ``wq``, ``weights_proj`` and ``wk`` stacked, a copy for
        :meth:`forward`'s ``stacked`` (one matmul reads the query weights in one pass, one more the
        key's) and the native kernel's packing; ``None`` when the queries project another input
        (``q_input_size != hidden_size``)."""
        if self.q_input_size != self.hidden_size:
            return None
        return torch.cat([self.wq.weight, self.weights_proj.weight, self.wk.weight]).detach().clone()

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, q_input: torch.Tensor | None = None,
                cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, *,
                stacked: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden [T, hidden_size]``, ``positions [T]`` -> ``(q_I [T, H, D], k_I [T, D], w [T, H])``,
        all fp32, RoPE applied, ``w`` scaled by ``D**-0.5 * H**-0.5``. Without ``q_input``, q and k
        share one buffer and one in-place neox RoPE (a decode step's few tokens pay per op, not per
        flop); the values are :meth:`queries`' and :meth:`keys`', bit for bit. ``stacked``: this
        module's :meth:`stacked_weight`, for one matmul over ``wq`` and ``weights_proj`` in place of two
        (equal up to its rounding; a decode step's weights are cold); ``k`` is then the key rows' own
        matmul, so it is :meth:`keys`' bit for bit whether or not the queries are projected (a prompt
        that only writes keys projects no query); refused with ``q_input`` or another shape."""
        h, d, r = self.n_heads, self.head_dim, self.rope_dim
        self._check_stacked(stacked, q_input, "")
        if q_input is not None:
            q, w = self.queries(hidden, positions, q_input, cos, sin)
            return q, self.keys(hidden, positions, cos, sin), w
        x = hidden.to(self.wk.weight.dtype)
        if stacked is None:
            q, w, k = self.wq(x), self.weights_proj(x), self.wk(x)
        else:
            q, w = nn.functional.linear(x, stacked[: h * d + h]).split((h * d, h), dim=-1)
            k = nn.functional.linear(x, stacked[h * d + h:])
        qk = torch.empty(x.shape[0], h + 1, d, dtype=torch.float32, device=x.device)  # q's heads, then k
        qk[:, :h] = q.view(-1, h, d)
        qk[:, h] = self.k_norm(k)
        if r and self.rope_interleave:
            qk = self._rope(qk, positions, cos, sin)
        elif r:  # neox, in place: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) on the first r channels
            if cos is None:
                cos, sin = rope_cos_sin(positions, r, self.rope_theta)
            c, s = cos[:, None, : r // 2].float(), sin[:, None, : r // 2].float()
            x1, x2 = qk[..., : r // 2], qk[..., r // 2: r]
            first, second = x1 * c - x2 * s, x2 * c + x1 * s
            x1.copy_(first)
            x2.copy_(second)
        return qk[:, :h], qk[:, h], w.float() * self.weight_scale


def save_projections(path: str, layers: dict[int, IndexerProjections], meta: dict | None = None) -> None:
    """Save per-layer projections (geometry + fp32 state dicts) to one ``torch.save`` file."""
    torch.save({"format": FORMAT, "meta": meta or {},
                "layers": {int(i): {"geometry": p.geometry(), "state": {k: v.float().cpu() for k, v in
                                                                         p.state_dict().items()}}
                           for i, p in layers.items()}}, path)


def _read(path: str) -> dict:
    """The contents of a :func:`save_projections` file (``ValueError`` for any other file)."""
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise ValueError(f"{path}: not a kvsieve DSA indexer file (format {FORMAT!r})")
    return blob


def projections_geometry(path: str) -> dict:
    """The indexer geometry every layer of a :func:`save_projections` file shares: ``n_heads``,
    ``head_dim``, ``rope_dim``, ``rope_interleave``, ``rope_theta`` (``ValueError`` when its layers
    disagree, naming them)."""
    blob = _read(path)
    keys = ("n_heads", "head_dim", "rope_dim", "rope_interleave", "rope_theta")
    found = {int(i): tuple(e["geometry"][k] for k in keys) for i, e in blob["layers"].items()}
    if len(set(found.values())) > 1:
        raise ValueError(f"{path}: its layers have different indexer geometries ({keys}): {found}")
    return dict(zip(keys, next(iter(found.values())))) if found else {}


def load_projections(path: str, device: torch.device | str = "cpu") -> tuple[dict[int, IndexerProjections], dict]:
    """Inverse of :func:`save_projections`: ``({layer: projections}, meta)``, fp32 whatever torch's
    default dtype (a vLLM worker sets it to the model's while it builds the model and its plug-in: the
    weights would be rounded to bf16 on loading)."""
    blob = _read(path)
    layers = {}
    for i, entry in blob["layers"].items():
        proj = IndexerProjections(**entry["geometry"]).float()  # fp32 before the saved values are copied in
        proj.load_state_dict(entry["state"])
        layers[int(i)] = proj.to(device).eval()
    return layers, blob["meta"]
