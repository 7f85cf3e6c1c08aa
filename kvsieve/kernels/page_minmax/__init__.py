"""Min/max key summaries of cache pages (Quest's and RocketKV's page summaries, refreshed when
tokens land in a page), on the CPU: the native C kernel beside its plain-PyTorch twin.

* ``keys [num_blocks, Hkv, block_size, D]``: one layer's K cache, any strides (channels
  contiguous, or tokens as in vLLM's CPU layout); fp32 or bf16 for the native kernel.
* ``blocks``, ``starts``, ``counts`` int64 numpy ``[n]``: page ``i`` is the ``counts[i]`` keys from
  token ``starts[i]`` of block ``blocks[i]``; ``starts[i]`` a multiple of ``page_size``,
  ``1 <= counts[i] <= page_size``, the page inside its block.
* ``pool [num_blocks, Hkv, block_size // page_size, 2, D]``: the summary pool (``[..., 0, :]`` =
  min, ``1`` = max), fp32 or bf16 for the native kernel, channel dimension contiguous; page ``i``
  writes ``pool[blocks[i], :, starts[i] // page_size]``, nothing else is written.

The min and max are taken in fp32 and rounded to the pool's dtype (round to nearest-even), so the
native kernel writes the values the twin writes (a min or a max of the inputs is one of them: no
sum, no order; only a zero's sign may differ where +0 and -0 tie). :func:`page_minmax` returns ``"native"`` or ``"naive"``: the native kernel runs
for CPU tensors of those dtypes and ``D <= 1024`` when its library builds (:mod:`kvsieve.kernels.common.native`); it
refuses a page outside its block with a ``ValueError`` before writing anything.

``plan`` (:func:`~.plan.page_minmax`: the native kernel where it takes the inputs and
its library builds, else the twin), ``native`` + ``page_minmax.c`` (the C kernel behind ctypes),
``naive`` (the plain twin).
"""
