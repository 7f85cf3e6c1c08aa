"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): a lightning indexer scores every cached token
for each query token, ``I[t, s] = sum_h w[t, h] * ReLU(q_I[t, h] . k_I[s])``, and each query
attends the ``index_topk`` best tokens (request-local positions, ``-1`` padded).

Per layer and step the caller passes the model's :class:`IndexerInputs` with the step
(``SparseAttention.forward(..., model_inputs=IndexerInputs(...))``, ``Engine.step(...,
model_inputs=[...])``; :attr:`DSASelector.model_inputs_type`), and the layer refuses a step
without them. ``on_append`` computes the index keys and writes them to the auxiliary paged pool
``dsa_index_k`` (``[num_blocks, tokens_per_block, head_dim]`` per layer, same block ids as the
main cache; FP8 E4M3 keys add ``dsa_index_k_scale [num_blocks, tokens_per_block]`` fp32, one
power-of-two scale per token). ``predict_attn`` computes the logits (Triton: ragged prefill for
fresh prompts, paged decode otherwise; or the PyTorch references) and the top-k with the engine
fixed at configuration time by ``kernels.topk.plan.choose_topk_engine``
(:attr:`DSASelector.topk_engine`); on the CPU with bf16/fp32 keys both in one native call
(``kernels.prompt_index``, :meth:`DSASelector._select_native`). A step whose every query sees at most ``index_topk`` tokens
skips both and selects everything (short-sequence fast path, counted in :attr:`stats`). On a
sliding-window layer the logits before each query's window are ``-inf`` and such positions are
never selected (:meth:`~kvsieve.sparse.SelectorInputs.mask_outside_window`, ``clip_to_window``);
when the window is no longer than ``index_topk`` (and no ``top_p``) the selection is the whole
window, so ``predict_attn`` answers ``None`` (dense; the backend applies the window), also
counted as a short-path step.

Adaptive budget (``top_p``, beyond DeepSeek-V3.2; Twilight, arXiv 2502.02770): a token's
estimated mass is ``softmax(I[t, :])`` over the query's visible tokens, the distribution the
indexer is trained to match (DeepSeek-V3.2's indexer loss ``KL(p || softmax(I))``, also the loss
of ``kvsieve distill-indexer``). Per query token the ``index_topk`` best tokens are taken in
descending ``I`` (ties to the lower position) and the list stops once the mass before the next
token reaches ``top_p``; the indexer is per token, so every KV head keeps the same set. The
short-sequence fast path is off with ``top_p`` (the cut needs the logits).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ...kernels.common.native import NativeUnavailable
from ...kernels.decode_layer.plan import DecodeProgram, IndexerStep
from ...kernels.indexer_project.native import IndexerProjectCall, pack_weight
from ...metadata import KVCacheManager
from ...sparse import BudgetKnob, Capabilities, SelectorInputs, SparseRuntimeParams, SparseSelector, register_selector
from ...sparse.knobs import KnobError, check_knobs, knob
from ..common.paged import drop_empty_columns, top_p_cut, top_p_knob
from .logits_chunks import logits_chunks
from .projections import IndexerInputs, IndexerProjections, load_projections, projections_geometry, rope_cos_sin

__all__ = ["DSAConfig", "DSASelector", "IndexerInputs", "INDEX_K_POOL", "INDEX_K_SCALE_POOL"]

INDEX_K_POOL = "dsa_index_k"
INDEX_K_SCALE_POOL = "dsa_index_k_scale"
_K_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float8_e4m3": torch.float8_e4m3fn}
_LOGITS = ("auto", "triton", "reference")
# the indexer geometry of DeepSeek-V3.2, the fields' values without a projections file
_DEEPSEEK_GEOMETRY = {"n_heads": 64, "head_dim": 128, "rope_dim": 64, "rope_interleave": False, "rope_theta": 10000.0}


@dataclass(frozen=True)
class DSAConfig:
    """``index_topk`` tokens per query; indexer geometry ``n_heads x head_dim`` with RoPE on the
    first ``rope_dim`` channels (``rope_interleave``: pairs instead of halves; ``rope_theta`` for
    the default RoPE): a geometry field left ``None`` is the ``projections`` file's (so
    ``dsa:projections=FILE,index_topk=512`` needs nothing else), without a file DeepSeek-V3.2's
    (64 x 128, RoPE on 64, neox halves, theta 10000); a field given that contradicts the file is
    refused, naming both; ``index_k_dtype`` of the aux pool (FP8 also quantizes the queries, their
    per-(token, head) scale folded into the weights); ``topk_engine`` (``auto``, ``torch``,
    ``radix``, ``gvr``, ``cute_gvr``) and ``logits_kernel`` (``auto``: Triton on CUDA, reference
    on CPU) are decided for ``device``; ``projections``: a file from ``kvsieve distill-indexer``;
    ``max_logits_elems`` bounds one logits chunk (rows x width fp32); ``top_p`` (``None``) turns
    ``index_topk`` into a cap (module docstring)."""

    index_topk: int = knob(2048, ge=1)
    n_heads: int | None = knob(None, ge=1)
    head_dim: int | None = knob(None, ge=1)
    rope_dim: int | None = knob(None, ge=0)
    rope_interleave: bool | None = None
    rope_theta: float | None = knob(None, gt=0)
    index_k_dtype: str = knob("bfloat16", choices=_K_DTYPES)
    topk_engine: str = "auto"
    logits_kernel: str = knob("auto", choices=_LOGITS)
    compress_ratio: int = knob(1, ge=1)
    device: str = "cpu"
    projections: str | None = None
    max_logits_elems: int = knob(1 << 26, ge=1)
    top_p: float | None = top_p_knob()

    def __post_init__(self) -> None:
        check_knobs(self, "dsa")
        from_file = projections_geometry(self.projections) if self.projections is not None else {}
        for name, default in _DEEPSEEK_GEOMETRY.items():
            value, stored = getattr(self, name), from_file.get(name)
            if value is None:
                object.__setattr__(self, name, type(default)(stored if stored is not None else default))
            elif stored is not None and value != stored:
                raise KnobError(f"dsa.{name}={value!r} contradicts the projections file {self.projections} "
                                f"({name}={stored!r}); leave it unset to take the file's")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise KnobError(f"dsa.rope_dim must be even and <= head_dim={self.head_dim}, got {self.rope_dim}")
        if self.compress_ratio != 1:
            raise KnobError(f"dsa.compress_ratio must be 1 (compressed index keys, DeepSeek-V4 style, are not "
                             f"implemented), got {self.compress_ratio}")
        if torch.device(self.device).type not in ("cpu", "cuda"):
            raise KnobError(f"dsa.device must be 'cpu' or 'cuda[:n]', got {self.device!r}")


@dataclass
class DSAStats:
    """Counters since construction: layer-steps served by the indexer vs the short fast path."""

    indexed_steps: int = 0
    short_path_steps: int = 0
    last_short_path: dict[int, bool] = field(default_factory=dict)


@register_selector
class DSASelector(SparseSelector):
    name = "dsa"
    config_class = DSAConfig
    capabilities = Capabilities(attention_kinds=frozenset({"gqa", "mla"}), sliding_window=True, per_kv_head=True)
    budget = BudgetKnob("index_topk", unit="tokens")
    model_inputs_type = IndexerInputs

    def __init__(self, config: DSAConfig | None = None, **overrides) -> None:
        super().__init__(config, **overrides)
        from ...kernels.topk.plan import choose_topk_engine  # kernels decorate lazily

        c = self.config
        dev = torch.device(c.device)
        self.topk_decision = choose_topk_engine(c.topk_engine, device=dev, index_topk=c.index_topk,
                                                compress_ratio=c.compress_ratio)
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        if c.logits_kernel == "triton" and dev.type != "cuda" and not interp:
            raise ValueError("dsa: logits_kernel='triton' needs a CUDA device or TRITON_INTERPRET=1 (tests)")
        self.logits_kernel = c.logits_kernel if c.logits_kernel != "auto" else (
            "triton" if dev.type == "cuda" else "reference")
        self.k_dtype = _K_DTYPES[c.index_k_dtype]
        self.projections: dict[int, IndexerProjections] = {}
        # each layer's stacked_weight() (torch's matmul) and, on the CPU, the native projection bound to its
        # copy in the kernel's layout (_bind_native); taken at set_projections
        self._stacked: dict[int, torch.Tensor | None] = {}
        self._native: dict[int, IndexerProjectCall | None] = {}
        if c.projections is not None:
            self.set_projections(load_projections(c.projections, dev)[0])
        self.stats = DSAStats()
        self._workspace = None
        self._rope_kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # _default_rope's last

    # ---- what was decided ----------------------------------------------------------------
    @property
    def topk_engine(self) -> str:
        """The top-k engine in use (``torch``, ``radix``, ``gvr`` or ``cute_gvr``)."""
        return self.topk_decision.engine

    # ---- inputs from the model integration ----------------------------------------------
    def set_projections(self, layers: dict[int, IndexerProjections]) -> None:
        """Install per-layer index projections (checked against the configured geometry). The
        selector projects with a copy of each layer's weights stacked (one matmul a step,
        :meth:`IndexerProjections.stacked_weight`; on the CPU also in the layout of the native projection
        kernel, :func:`~kvsieve.kernels.indexer_project.native.pack_weight`): install them again after
        changing them."""
        c = self.config
        for i, p in layers.items():
            if (p.n_heads, p.head_dim, p.rope_dim, p.rope_interleave, float(p.rope_theta)) != (
                    c.n_heads, c.head_dim, c.rope_dim, c.rope_interleave, float(c.rope_theta)):
                raise ValueError(
                    f"dsa: layer {i} projections have n_heads={p.n_heads}, head_dim={p.head_dim}, "
                    f"rope_dim={p.rope_dim}, rope_interleave={p.rope_interleave}, rope_theta={p.rope_theta}; "
                    f"the config has {c.n_heads}, {c.head_dim}, {c.rope_dim}, {c.rope_interleave}, {c.rope_theta}")
        self.projections.update(layers)
        stacked = {i: p.stacked_weight() for i, p in layers.items()}
        self._stacked.update(stacked)
        self._native.update({i: _bind_native(layers[i], w) for i, w in stacked.items()})

    # ---- hooks ---------------------------------------------------------------------------
    def on_append(self, inputs: SelectorInputs) -> None:
        """Compute the index keys of the step's tokens (from ``inputs.model_inputs``, this step's
        :class:`IndexerInputs`, which the layer checked) and write them into the aux pool; when a phase
        of the step selects, also their index queries and weights, which :meth:`predict_attn` reads."""
        md = inputs.metadata
        if not inputs.phases:  # no row of this step selects (a decode-only DSA's prompt): its keys alone
            k = self.index_keys(inputs.layer_idx, inputs.model_inputs, md.positions)
            q = w = None
        else:
            q, k, w = self.index_tensors(inputs.layer_idx, inputs.model_inputs, md.positions)
        if k.shape[0] != md.num_tokens:
            raise ValueError(f"dsa: IndexerInputs cover {k.shape[0]} tokens, the step has {md.num_tokens}")
        self._write_keys(inputs, k)
        if q is None:
            return
        if self.k_dtype == torch.float8_e4m3fn:
            from ...kernels.dsa_indexer.quant import quantize_pow2_fp8

            q, q_scale = quantize_pow2_fp8(q)  # per (token, head), folded into the weights
            w = w * q_scale
        elif self.k_dtype != torch.float32:
            q = q.to(self.k_dtype)
        inputs.state["index_qw"] = (q, w.float().contiguous())

    def index_tensors(self, layer: int, ii: IndexerInputs, positions: torch.Tensor, *,
                      q_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 index ``q [T, H, Di]``, ``k [T, Di]`` and ``w [T, H]`` of the step's tokens (at
        ``positions [T]``) from this layer's :class:`IndexerInputs`: given finished, or projected
        from the hidden state by the layer's :class:`IndexerProjections`; q rounded to ``q_dtype``'s
        precision (``q.to(q_dtype).float()``; the native projection rounds to bf16 itself). Writes
        nothing: a debug check may call it again (:mod:`kvsieve.integrations.vllm.state_check`). Another
        ``q_dtype`` than fp32 or bf16 is refused (FP8 queries are quantized with scales, not rounded)."""
        if q_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dsa: index_tensors rounds q to float32 or bfloat16, not q_dtype={q_dtype}")
        if ii.is_finished:
            q, k, w = ii.q_index.float(), ii.k_index.float(), ii.weights.float()
            q = q if q_dtype == torch.float32 else q.to(q_dtype).float()
        else:
            positions, cos, sin = self._rope_inputs(layer, ii, positions)
            with torch.no_grad():  # index tensors only select: no gradient flows through them
                q, k, w = self._project(layer, ii, positions, cos, sin, q_dtype)
        c = self.config
        if q.shape[1:] != (c.n_heads, c.head_dim) or k.shape[1:] != (c.head_dim,) or w.shape[1:] != (c.n_heads,):
            raise ValueError(f"dsa: index tensors must be q [T, {c.n_heads}, {c.head_dim}], k [T, {c.head_dim}], "
                             f"w [T, {c.n_heads}]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(w.shape)}")
        return q, k, w

    def index_keys(self, layer: int, ii: IndexerInputs, positions: torch.Tensor) -> torch.Tensor:
        """fp32 index keys ``k [T, Di]`` of the step's tokens: :meth:`index_tensors`' ``k`` bit for bit,
        without projecting the queries where the module projects (a step longer than the native call
        takes; the queries are a ``H x Di + H`` wide matmul beside the key's ``Di``). Writes nothing."""
        if ii.is_finished:
            k = ii.k_index.float()
        else:
            positions, cos, sin = self._rope_inputs(layer, ii, positions)
            call = self._native[layer]
            if call is not None and ii.q_input is None and call.takes(ii.hidden, cos, sin):
                k = self.index_tensors(layer, ii, positions)[1]  # the native call projects all three at once
            else:
                with torch.no_grad():
                    stacked = self._stacked[layer] if ii.q_input is None else None  # as _project's module call
                    k = self.projections[layer].keys(ii.hidden, positions, cos, sin, stacked=stacked)
        if k.shape[1:] != (self.config.head_dim,):
            raise ValueError(f"dsa: index keys must be k [T, {self.config.head_dim}]; got {tuple(k.shape)}")
        return k

    def _rope_inputs(self, layer: int, ii: IndexerInputs, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(positions, cos, sin)`` on the hidden state's device for projecting ``ii.hidden``: the
        inputs' own RoPE, else the configured default (none without ``rope_dim``). Refuses a layer
        without projections."""
        if layer not in self.projections:
            raise RuntimeError(f"dsa: layer {layer} got hidden states but has no IndexerProjections; load a "
                               "projections file (config 'projections') or call set_projections")
        positions = positions.to(ii.hidden.device)
        cos, sin = ii.cos, ii.sin
        if cos is None and self.config.rope_dim:  # the default RoPE of the configured rope_theta
            cos, sin = self._default_rope(positions)
        return positions, cos, sin

    def _project(self, layer: int, ii: IndexerInputs, positions: torch.Tensor, cos: torch.Tensor | None,
                 sin: torch.Tensor | None, q_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's projections of ``ii.hidden``, q rounded to ``q_dtype``'s precision: a CPU step of
        at most ``MAX_TOKENS`` tokens (a decode step) in one native call bound to the layer
        (:mod:`kvsieve.kernels.indexer_project`: the same values to fp32 rounding, without some twenty
        torch dispatches), everything else as torch ops. Every path that projects a step (the engine's
        hooks, the vLLM plug-in's native and Python paths) comes here, so they agree bit for bit."""
        call = self._native[layer]
        if call is not None and ii.q_input is None and call.takes(ii.hidden, cos, sin):
            try:
                return call.run(ii.hidden, cos, sin, round_q_bf16=q_dtype == torch.bfloat16)
            except NativeUnavailable:
                pass
        q, k, w = self.projections[layer](ii.hidden, positions, ii.q_input, cos, sin,
                                          stacked=self._stacked[layer] if ii.q_input is None else None)
        return q if q_dtype == torch.float32 else q.to(q_dtype).float(), k, w

    def _default_rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`rope_cos_sin` of the configured RoPE at ``positions [T]``. Every selecting layer of a
        step asks for the same positions, so on the CPU the last answer is returned again while they
        are equal (the same values: computed once a step, not once a layer); on a GPU comparing them
        would wait for the device, so each call computes its own."""
        c = self.config
        on_cpu, kept = positions.device.type == "cpu", self._rope_kept
        if on_cpu and kept is not None and kept[0].shape == positions.shape and torch.equal(kept[0], positions):
            return kept[1], kept[2]
        cos, sin = rope_cos_sin(positions, c.rope_dim, c.rope_theta)
        if on_cpu:
            self._rope_kept = (positions.clone(), cos, sin)
        return cos, sin

    def decode_program(self, cache: KVCacheManager, layer_idx: int, head_dim: int) -> DecodeProgram | None:
        """The indexer's logits and top-k over the key pool (bf16 or fp32 keys; none with ``top_p``,
        FP8 keys or a layer without projections)."""
        c = self.config
        if c.top_p is not None or self.k_dtype not in (torch.bfloat16, torch.float32) or layer_idx not in self.projections:
            return None
        pool = cache.add_aux_pool(INDEX_K_POOL, (cache.tokens_per_block, c.head_dim), self.k_dtype)[layer_idx]
        return DecodeProgram("indexer", units=c.index_topk, index_keys=pool)

    def decode_step_inputs(self, layer_idx: int, model_inputs: IndexerInputs, positions: torch.Tensor) -> IndexerStep:
        """The rows' index queries rounded to the key pool's dtype (as ``on_append`` rounds them),
        weights and keys, fp32."""
        q, k, w = self.index_tensors(layer_idx, model_inputs, positions, q_dtype=self.k_dtype)
        return IndexerStep(q.contiguous(), w.contiguous(), k.contiguous())

    def index_pools(self, inputs: SelectorInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This layer's aux pools: index keys ``[num_blocks, tokens_per_block, head_dim]`` and, for FP8
        keys, their scales ``[num_blocks, tokens_per_block]`` (else ``None``), by physical block id."""
        cache = inputs.cache
        p, d = cache.tokens_per_block, self.config.head_dim
        k_pool = cache.add_aux_pool(INDEX_K_POOL, (p, d), self.k_dtype)[inputs.layer_idx]
        s_pool = None
        if self.k_dtype == torch.float8_e4m3fn:
            s_pool = cache.add_aux_pool(INDEX_K_SCALE_POOL, (p,), torch.float32)[inputs.layer_idx]
        return k_pool, s_pool

    def _write_keys(self, inputs: SelectorInputs, k: torch.Tensor) -> None:
        md = inputs.metadata
        k_pool, s_pool = self.index_pools(inputs)
        blk, off = inputs.cache.physical(md.slots[md.token_to_req_host], md.positions_host)
        keys, scales = self.stored_keys(k)
        k_pool[blk, off] = keys
        if s_pool is not None:
            s_pool[blk, off] = scales

    def stored_keys(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Index keys ``k [T, head_dim]`` as the aux pool holds them: ``(keys [T, head_dim]`` in
        ``index_k_dtype``, per-token power-of-two scales ``[T]`` fp32 for FP8 keys, else ``None)``."""
        if self.k_dtype != torch.float8_e4m3fn:
            return k.to(self.k_dtype), None
        from ...kernels.dsa_indexer.quant import quantize_pow2_fp8

        return quantize_pow2_fp8(k)

    def predict_attn(self, inputs: SelectorInputs) -> SparseRuntimeParams | None:
        layer = inputs.layer_idx
        q, w = inputs.state["index_qw"]  # this step's index q / weights, from on_append
        lens = inputs.row_kv_lens
        kk = self.config.index_topk
        lens_host = inputs.token_kv_lens_host()[inputs.rows]
        dev = lens.device
        if torch.device(self.config.device).type != dev.type:
            raise ValueError(f"dsa: configured for device {self.config.device!r} but the cache is on {dev}")
        if inputs.window is not None and self.config.top_p is None and kk >= inputs.window:
            # the top index_topk of a window no longer than index_topk is all of it: dense in the
            # window, which the layer's backend applies (a carrier listing it costs O(rows x window))
            self.stats.short_path_steps += 1
            self.stats.last_short_path[layer] = True
            return None
        if inputs.num_rows == 0 or (int(lens_host.max()) <= kk and self.config.top_p is None):
            self.stats.short_path_steps += 1
            self.stats.last_short_path[layer] = True
            pos = torch.arange(min(kk, int(lens_host.max(initial=1))), device=dev, dtype=torch.int32)
            sel = torch.where(pos < lens.unsqueeze(1), pos, -1)
        else:
            self.stats.indexed_steps += 1
            self.stats.last_short_path[layer] = False
            sel = self._select(inputs, q.to(dev), w.to(dev))
        sel = inputs.clip_to_window(sel, lens)
        sel = sel.unsqueeze(1).expand(-1, inputs.num_kv_heads, -1)
        return SparseRuntimeParams.from_topk(sel)

    # ---- logits + top-k ------------------------------------------------------------------
    def _select(self, inputs: SelectorInputs, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from ...kernels.topk.plan import TopKWorkspace, run_topk

        md = inputs.metadata
        native = self._select_native(inputs, q, w)
        if native is not None:
            return native
        if self._workspace is None or self._workspace.max_rows < md.max_num_tokens:
            self._workspace = TopKWorkspace(self.topk_decision, md.max_num_tokens, md.token_kv_lens.device)
        k_pool, s_pool = self.index_pools(inputs)
        lens, r0 = md.token_kv_lens, inputs.rows.start
        out = torch.empty(inputs.num_rows, self.config.index_topk, dtype=torch.int32, device=lens.device)
        for rows, logits in logits_chunks(inputs, q, w, k_pool, s_pool, self.logits_kernel,
                                          self.config.max_logits_elems):
            logits = inputs.mask_outside_window(logits, lens[rows])
            picked = run_topk(self._workspace, logits, lens[rows].contiguous())
            if self.config.top_p is not None:
                picked = _top_p_tokens(picked, logits, lens[rows], self.config.top_p)
            out[rows.start - r0: rows.stop - r0] = picked
        return out if self.config.top_p is None else drop_empty_columns(out)

    def _select_native(self, inputs: SelectorInputs, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        """The rows' top ``index_topk`` ``[rows, index_topk]`` int32 (ascending, ``-1`` after) by one CPU call
        (:mod:`kvsieve.kernels.prompt_index`: no ``[rows x len]`` logits), or ``None`` where it does not apply:
        a logits kernel other than ``reference``, FP8 keys, ``top_p``, a sliding window, or no library."""
        from ...kernels.prompt_index.native import prompt_index_topk_native, supports_prompt_index

        k_pool, s_pool = self.index_pools(inputs)
        if (self.logits_kernel != "reference" or s_pool is not None or self.config.top_p is not None
                or inputs.window is not None or not supports_prompt_index(k_pool, q)):
            return None
        md, rows = inputs.metadata, inputs.rows
        try:
            return prompt_index_topk_native(k_pool, inputs.cache.block_table, md.slots[md.token_to_req_host[rows]],
                                            inputs.token_kv_lens_host()[rows], q[rows], w[rows],
                                            self.config.index_topk)
        except NativeUnavailable:
            return None


def _top_p_tokens(picked: torch.Tensor, logits: torch.Tensor, lens: torch.Tensor, p: float) -> torch.Tensor:
    """int32 ``[n, k]``: the top-k ``picked [n, k]`` (any order, ``-1`` padded) of index logits
    ``logits [n, width]`` (``lens [n]`` visible each) in descending logit (ties to the lower
    position), cut where ``softmax`` mass over the visible tokens reaches ``p``, ``-1`` after."""
    valid = torch.arange(logits.shape[1], device=logits.device) < lens.unsqueeze(1)
    logp = torch.log_softmax(logits.float().masked_fill(~valid, float("-inf")), dim=-1)
    ids = SparseRuntimeParams.sort_padding_last(picked.to(torch.int64))
    unused = (ids < 0) | (ids >= logits.shape[1])
    val = torch.gather(logp, 1, ids.clamp(0, logits.shape[1] - 1)).masked_fill(unused, float("-inf"))
    order = torch.sort(val, dim=-1, descending=True, stable=True).indices
    ranked = torch.gather(torch.where(unused, -1, ids), 1, order)
    mass = torch.gather(val, 1, order).exp()
    return top_p_cut(ranked, mass, torch.ones_like(mass[:, 0]), p).to(torch.int32)


def _bind_native(proj: IndexerProjections, stacked: torch.Tensor | None) -> IndexerProjectCall | None:
    """The native projection bound to a layer whose weights are on the CPU (``stacked``: its stacked
    weight), or ``None`` where the kernel does not compute the module's function: interleaved RoPE, a
    key norm other than none (``nn.Identity``) or an affine LayerNorm."""
    if stacked is None or stacked.device.type != "cpu" or proj.rope_interleave:
        return None
    norm = proj.k_norm if isinstance(proj.k_norm, nn.LayerNorm) else None
    if (norm is None and not isinstance(proj.k_norm, nn.Identity)) or (
            norm is not None and (norm.weight is None or norm.bias is None)):
        return None
    return IndexerProjectCall(pack_weight(stacked), None if norm is None else norm.weight.detach(),
                              None if norm is None else norm.bias.detach(), 0.0 if norm is None else norm.eps,
                              proj.n_heads, proj.head_dim, proj.rope_dim, proj.weight_scale)
