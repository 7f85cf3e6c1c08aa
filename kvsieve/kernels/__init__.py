"""kvsieve kernels, one folder per operation (as flash-linear-attention's ``ops/<op>/``).

An op folder holds its implementations beside one plain-PyTorch reference, ``naive.py`` (same
signatures): ``triton.py`` (Triton, any CUDA GPU; CPU under ``TRITON_INTERPRET=1``), ``cute.py``
or ``cute/`` (CuTe-DSL, SM90/SM100), ``native.py`` + ``<op>.c`` (C for the host CPU, built on
first use), ``plan.py`` (the launch plan: argument checks, which implementation or engine runs
and with what launch parameters, shared by an implementation and its reference). A package's
``__init__`` only describes it: every implementation is imported by its module path, so nothing
loads Triton or CuTe until it is named.

Ops: ``sparse_gqa_decode``, ``sparse_mla_decode``, ``paged_prefill``, ``compact_kv``, ``topk``,
``dsa_indexer``, ``page_topk``, ``page_minmax``, ``head_tables``, ``segment_check``, ``prompt_runs``,
``prompt_index``, ``block_bound``. Pieces several
ops share are in ``common`` (an op imports no other op); ahead-of-time compile reports and the
CuTe bundle builder are in ``aot``.
"""
