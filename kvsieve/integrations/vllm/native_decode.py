"""A decode step's per-layer work in one call (free of vLLM imports): on the CPU one native call,
on CUDA the fixed-shape device path (no host synchronisation: capturable in a CUDA graph).

When every row of a step is one request's one new token (a decode step) and the layer's selector
has a native program (:meth:`~kvsieve.sparse.SparseSelector.decode_program`: ``quest``,
``block_select``, ``streaming``, ``oracle_topk``, ``dsa``), the plug-in does not build the step's
kvsieve metadata, selector inputs or carrier: :class:`NativeDecodeLayer` hands the step's block
table and lengths (vLLM's own host arrays, read once per step by the metadata builder) with the
layer's q and output to :class:`~kvsieve.kernels.decode_layer.native.DecodeLayerCall`, which
updates the selector's per-block state (page summaries, index keys: the same pools the Python hooks
keep), selects, and attends over vLLM's cache in place. Everything else (prompt rows, mixed steps,
the golden capture, a selector or config without a program, the library unavailable) takes
:class:`~.step.LayerRunner`, whose Python hooks are the references the native path is tested
against. On CUDA (:class:`DeviceDecodeLayer`) the same programs run as batched torch on vLLM's device
block table and lengths (:func:`~kvsieve.kernels.decode_layer.device.decode_layer_device`), so a
decode step reads nothing back to the host.
"""
from __future__ import annotations

import numpy as np
import torch

from ...kernels.common.native import NativeUnavailable
from ...kernels.decode_layer.device import decode_layer_device
from ...kernels.decode_layer.native import DecodeLayerCall, supports_decode_layer
from ...kernels.decode_layer.plan import DecodeProgram, IndexerStep
from ...kernels.page_minmax.plan import page_minmax
from ...metadata.foreign_paged import ForeignPagedKV
from ...sparse import AttentionGeometry, LayerPlan

__all__ = ["DeviceDecodeLayer", "NativeDecodeLayer", "decode_layer_path"]


class _OneCallLayer:
    """What both one-call paths share: the layer's selector, and the per-step inputs of a program
    that reads model inputs (DSA's index queries, weights and keys, from this layer's hidden state)."""

    def __init__(self, plan: LayerPlan, layer_idx: int) -> None:
        self.selector, self.layer_idx = plan.selector, layer_idx
        self.reads_model_inputs = plan.selector.model_inputs_type is not None

    def _step_inputs(self, model_inputs: object, positions: torch.Tensor) -> IndexerStep | None:
        if not self.reads_model_inputs:
            return None
        return self.selector.decode_step_inputs(self.layer_idx, model_inputs, positions)


class NativeDecodeLayer(_OneCallLayer):
    """One layer's decode steps through one :class:`DecodeLayerCall` each."""

    def __init__(self, call: DecodeLayerCall, plan: LayerPlan, layer_idx: int) -> None:
        super().__init__(plan, layer_idx)
        self.call = call

    def run(self, table: np.ndarray, kv_lens: np.ndarray, positions: torch.Tensor, q: torch.Tensor,
            out: torch.Tensor, model_inputs: object = None) -> np.ndarray:
        """``table [N, W]`` / ``kv_lens [N]`` int32 the step's rows (vLLM's order), ``positions [N]``
        int64 their new tokens' positions (``kv_lens - 1``), q/out ``[N, Hq, D]``; ``model_inputs``: what
        the selector reads per step (its type, this layer's, vLLM's row order). Writes ``out``;
        returns ``attended [N, Hkv]`` int64."""
        return self.call.run(table, kv_lens, q, out, self._step_inputs(model_inputs, positions))

    def refresh_pages(self, table: np.ndarray, kv_lens: np.ndarray) -> None:
        """Recompute each row's newest page summary from the cache over its positions up to its new
        token's (``kv_lens - 1``, already written), for a program that keeps page summaries (``pool``;
        others keep nothing a later position could have touched). A verify pass summarized every
        position it wrote, the rejected ones too: a summary recomputed over the valid positions is
        the one the Python hooks keep, and the call's update then adds the new key to it again
        (min/max: no change). ``table [N, W]`` / ``kv_lens [N]`` int32 as :meth:`run`'s."""
        program = self.call.program
        if program.pool is None:
            return
        bs = self.call.k.shape[2]
        pos = kv_lens.astype(np.int64) - 1
        within = pos % bs
        starts = within - within % program.page_size
        page_minmax(self.call.k, table[np.arange(pos.size), pos // bs].astype(np.int64), starts, within - starts + 1,
                    program.pool)


class DeviceDecodeLayer(_OneCallLayer):
    """One layer's decode steps on the device (:func:`decode_layer_device`): ``k``/``v [num_blocks,
    Hkv, block_size, D]`` views of the layer's cache, the program bound once."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, program: DecodeProgram, plan: LayerPlan, layer_idx: int,
                 sm_scale: float) -> None:
        super().__init__(plan, layer_idx)
        self.k, self.v, self.program, self.sm_scale = k, v, program, sm_scale

    def run(self, table: torch.Tensor, kv_lens: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
            out: torch.Tensor, model_inputs: object = None) -> torch.Tensor:
        """As :meth:`NativeDecodeLayer.run` with ``table [N, W]``, ``kv_lens [N]`` and ``positions [N]``
        on the device (vLLM's own tensors; a row of length 0 is padding); returns ``attended [N, Hkv]``
        on the device."""
        return decode_layer_device(self.k, self.v, self.program, table, kv_lens, q, out, sm_scale=self.sm_scale,
                                   index=self._step_inputs(model_inputs, positions))


def decode_layer_path(plan: LayerPlan | None, view: ForeignPagedKV, layer_idx: int, k: torch.Tensor,
                      v: torch.Tensor, geometry: AttentionGeometry) -> NativeDecodeLayer | DeviceDecodeLayer | None:
    """The layer's one-call decode path, or ``None`` where it has none: no plan, a plan that does not
    select in the generation phase, a selector or config without a program; on the CPU also a cache
    or geometry the kernel does not take (``k``/``v [num_blocks, Hkv, block_size, D]`` views of the
    layer's cache; ``view`` holds the selector's pools) or no library (``KVSIEVE_NATIVE=0``, no
    compiler). On CUDA: :class:`DeviceDecodeLayer`."""
    if plan is None or "generation" not in plan.phases or geometry.kind != "gqa" or geometry.value_dim != geometry.head_dim:
        return None
    program = plan.selector.decode_program(view, layer_idx, geometry.head_dim)
    if program is None:
        return None
    if k.device.type == "cuda":
        return DeviceDecodeLayer(k, v, program, plan, layer_idx, geometry.sm_scale)
    if not supports_decode_layer(k, v, geometry.num_q_heads, program):
        return None
    try:
        call = DecodeLayerCall(k, v, program, num_q_heads=geometry.num_q_heads, sm_scale=geometry.sm_scale)
    except NativeUnavailable:
        return None
    return NativeDecodeLayer(call, plan, layer_idx)
