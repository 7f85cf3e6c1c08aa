"""One attention layer's decode step in one native call: the selector's per-step state update, its
selection and the attention over what it selected (CPU).

Inputs of one call (:class:`~.native.DecodeLayerCall`): ``N`` decode rows, each one request's new
token, already written to the cache:

* ``table [N, W]`` int32: each row's physical cache blocks; ``kv_lens [N]`` int32: its positions
  (the new token's included);
* the layer's cache views ``k``/``v [num_blocks, Hkv, block_size, D]`` (bf16 or fp32; K by rows or by
  channel as in vLLM's CPU layout, V by rows), read in place;
* ``q``/``out [N, Hq, D]`` (bf16 or fp32, ``Hq = Hkv * G``, query head ``j`` in KV group ``j // G``);
* the layer's :class:`~.plan.DecodeProgram`: what the selector does (``decode_layer.c``'s header:
  Quest pages, streaming, oracle top-k, block selection exact or from summaries, the DSA indexer)
  with the pools it keeps (page summaries, index keys), and, for the indexer, the step's
  :class:`~.plan.IndexerStep`.

Output: ``out`` written (softmax attention of each query head over its KV head's selected positions,
fp32 inside) and ``attended [N, Hkv]`` int64, the positions each (row, KV head) read. The selection
rules are the selectors' own (``kvsieve.selectors``: each selector's ``decode_program`` says which
program reproduces its ``predict_attn`` on decode rows); those Python paths, and the run attention
of ``kernels.sparse_gqa_decode`` whose code this kernel shares (``common/include/attend_runs.h``,
``page_rank.h``) and the page summaries' refresh (``kernels.page_minmax``), are the references it is tested against.
"""
