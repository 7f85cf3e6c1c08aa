"""The backend interface: compute attention over exactly the selected set and return what was done.

A backend is a narrow object: it declares the metadata translation it reads
(``required_translations``), whether it reads whole KV pages (``kv_page_granular``), and
``forward`` returns an :class:`AttentionResult` (output, LSE, the positions really read, the
kernel paths taken per phase, skip-softmax tile counters). Nothing is kept on the backend
between calls. Built-ins register with ``@register_backend``; other packages use the
``kvsieve.backends`` entry-point group (:mod:`kvsieve.sparse.registry`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch

from ...metadata import AttentionMetadata
from ..params import SparseRuntimeParams
from ..registry import Registry
from ..selection import attended_counts

__all__ = ["AttentionGeometry", "AttentionBackend", "AttentionResult", "BackendCapabilities", "BACKENDS",
           "BACKEND_ENTRY_POINT_GROUP", "register_backend"]

_FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend computes exactly, asked before any step (vLLM's ``supports_*`` questions,
    answered by the backend):

    * ``attention_kinds``: ``"gqa"`` and/or ``"mla"``;
    * ``dtypes``: query/cache dtypes;
    * ``devices``: device types (``"cpu"``, ``"cuda"``) its kernels run on;
    * ``skip_softmax_devices``: device types on which it runs skip-softmax thresholds (empty: none);
    * ``softcap``: it applies attention-logit soft-capping itself; ``sinks``: learned attention sinks;
    * ``torch_softcap``: its math is plain PyTorch over the selection, so a soft-capped layer may
      run plain-PyTorch softcapped attention over the same selection in its place and still be
      what this backend computes, with the cap (the transformers bridge's
      :class:`~kvsieve.integrations.transformers.feature_backend.FeatureBackend` does; a backend
      without it, e.g. a kernel backend, is refused on a soft-capped model, by name);
    * ``window``: it applies a sliding-window layer's window itself. A backend without it gets
      the window applied to its selection by :class:`~kvsieve.sparse.SparseAttention`
      (:func:`kvsieve.sparse.window.window_params`), so every backend honours windows.
    """

    attention_kinds: frozenset[str] = frozenset({"gqa", "mla"})
    dtypes: frozenset[torch.dtype] = _FLOATS
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    skip_softmax_devices: frozenset[str] = frozenset()
    softcap: bool = False
    torch_softcap: bool = False
    sinks: bool = False
    window: bool = False


@dataclass(frozen=True)
class AttentionGeometry:
    """Shapes of one attention layer. MLA (absorbed): q width ``kv_lora_rank + rope_dim``,
    one latent KV head, output width ``kv_lora_rank``."""

    kind: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    sm_scale: float
    kv_lora_rank: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("gqa", "mla"):
            raise ValueError(f"AttentionGeometry.kind must be 'gqa' or 'mla', got {self.kind!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.kind == "mla" and (self.num_kv_heads != 1 or not 0 < self.kv_lora_rank <= self.head_dim):
            raise ValueError("MLA geometry needs num_kv_heads=1 and 0 < kv_lora_rank <= head_dim")

    @property
    def value_dim(self) -> int:
        return self.kv_lora_rank if self.kind == "mla" else self.head_dim


@dataclass(frozen=True)
class AttentionResult:
    """What one :meth:`AttentionBackend.forward` computed for one layer and step.

    * ``out [num_tokens, Hq, Dv]`` in q's dtype;
    * ``lse [num_tokens, Hq]`` fp32 natural-log LSE, or ``None`` when the path computes none
      (the SDPA dense path); a query with no valid entry has out 0 and lse ``+inf``;
    * ``attended`` int64 ``[num_tokens, Hkv]``: positions read per (query, KV head), a backend
      that gathers whole pages counting every touched page whole;
    * ``paths``: phase (``"context"``/``"generation"``) -> kernel path taken (a composite that
      hands a phase to another backend names it, e.g. ``"triton:sparse_gather"``);
    * ``skipped_tiles`` / ``walked_tiles``: skip-softmax counters over the phases with a factor
      (0 / 0 when it did not run); every backend that implements it counts the Triton kernels' tiles.
    """

    out: torch.Tensor
    lse: torch.Tensor | None
    attended: torch.Tensor
    paths: dict[str, str] = field(default_factory=dict)
    skipped_tiles: int = 0
    walked_tiles: int = 0


class AttentionBackend(ABC):
    """Computes attention of a step's query tokens over the paged cache, as ``params`` select.

    Rows of a phase for which :func:`kvsieve.sparse.params.is_dense` holds attend densely and
    causally. What it can compute is declared in ``capabilities``; :meth:`refusal` answers whether
    a combination runs, and the layer, :func:`~kvsieve.sparse.lower_config` and the
    :class:`~kvsieve.sparse.Engine` refuse an impossible one before any step.
    """

    name: ClassVar[str]
    required_translations: ClassVar[tuple[str, ...]] = ()
    kv_page_granular: ClassVar[bool] = False
    capabilities: BackendCapabilities = BackendCapabilities()

    def refusal(self, *, attention_kind: str | None = None, device: str | torch.device | None = None,
                dtype: torch.dtype | None = None, skip_softmax: bool = False, softcap: bool = False,
                sinks: bool = False) -> str | None:
        """Why this backend cannot run the combination (one sentence naming the feature and what
        it supports), or ``None`` when it can; ``None`` arguments are not asked about."""
        cap = self.capabilities
        dev = None if device is None else torch.device(device).type
        for what, value, allowed in (("attention kind", attention_kind, cap.attention_kinds),
                                     ("device", dev, cap.devices), ("dtype", dtype, cap.dtypes)):
            if value is not None and value not in allowed:
                supported = sorted(map(str, allowed))
                return f"backend {self.name!r} does not support {what} {value!r}; supported: {supported}"
        if skip_softmax and not cap.skip_softmax_devices:
            return f"backend {self.name!r} does not run skip-softmax thresholds"
        if skip_softmax and dev is not None and dev not in cap.skip_softmax_devices:
            return (f"backend {self.name!r} runs skip-softmax thresholds only on {sorted(cap.skip_softmax_devices)}, "
                    f"not on {dev!r}")
        for what, wanted, has in (("attention logit soft-capping", softcap, cap.softcap),
                                  ("attention sinks", sinks, cap.sinks)):
            if wanted and not has:
                return f"backend {self.name!r} does not apply {what}"
        return None

    def check(self, **combination: object) -> None:
        """Raise ``ValueError`` with :meth:`refusal`'s reason when the combination cannot run."""
        reason = self.refusal(**combination)
        if reason is not None:
            raise ValueError(reason)

    @abstractmethod
    def forward(self, q: torch.Tensor, metadata: AttentionMetadata, layer_idx: int, geometry: AttentionGeometry,
                params: SparseRuntimeParams | None) -> AttentionResult:
        """q ``[num_tokens, Hq, D]`` (rows ordered as the metadata's requests, context first)."""

    def effective_attended_tokens(self, params: SparseRuntimeParams | None, metadata: AttentionMetadata,
                                  geometry: AttentionGeometry) -> torch.Tensor:
        """int64 ``[num_tokens, num_kv_heads]``: positions this backend reads per query; a backend
        that gathers whole KV pages rounds every touched page up; dense-phase rows read all."""
        page = metadata.kv_cache_manager.tokens_per_block if self.kv_page_granular else 1
        selected = [metadata.phase_rows(p) for p in metadata.phases()
                    if params is not None and params.selects_positions(p)]
        return attended_counts(params, metadata.token_kv_lens, geometry.num_kv_heads, page, selected)


BACKEND_ENTRY_POINT_GROUP = "kvsieve.backends"
# the built-ins' "module:class" table is filled by the package (kvsieve/sparse/backends/__init__.py),
# which sits above the backend modules: this module, which they all import, names none of them
BACKENDS: Registry[type[AttentionBackend]] = Registry("backend", AttentionBackend, BACKEND_ENTRY_POINT_GROUP)
B = TypeVar("B", bound=type[AttentionBackend])


def register_backend(cls: B) -> B:
    """Class decorator: register a backend under ``cls.name`` (mirrors ``register_selector``)."""
    return BACKENDS.register(cls)
