"""Per-(row, KV head) block tables of a whole-block selection, for a host engine's paged kernel
(the vLLM plug-in's ``host_paged`` path): the native C builder beside its plain ``naive`` twin.

Inputs (host numpy, int32):

* ``indices [H, total]`` and ``offsets [n + 1]``: the ``n`` rows' block selections (a carrier's
  ``sparse_attn_indices`` / ``sparse_attn_offsets`` cut to those rows, block size = the cache's
  block), validated: per (head, row) the valid block indices ascending, ``-1`` padding after them;
* ``table [n, W]``: each row's request's physical block ids in order;
* ``kv_lens [n]``: positions in each row's request.

:func:`head_tables` returns ``(pseudo [n * H, width], seq_lens [n * H])`` int32, or ``None`` when
some (row, head) selects no block; a selected block at or past its row's length (or its table row)
raises ``ValueError`` (both builders check it: nothing outside the table is read). Pseudo-request ``r * H + h`` reads the pseudo-blocks
``block * H + h`` of its selected blocks, in order (``width`` = the longest segment; entries past
its own blocks are 0 and not read), and ``seq_lens`` positions of them: every selected block whole
but the last, which ends at the request's length (only a request's newest block is partial). The
native builder writes them in one pass (about a microsecond for a decode step); the naive twin
(a dozen numpy ops) runs where its library is unavailable.

``plan`` (:func:`~.plan.head_tables`: the native kernel where it takes the inputs and
its library builds, else the twin), ``native`` + ``head_tables.c`` (the C kernel behind ctypes),
``naive`` (the plain twin).
"""
