"""The checks of a selection carrier's ``(indices, offsets)`` pair (``SparseRuntimeParams.validate``),
on the host: the native C checker beside its plain ``naive`` twin.

Rules, for ``indices [H, total]`` int32 and ``offsets [n + 1]`` int32 (row ``r``, head ``h`` owns
``indices[h, offsets[r]:offsets[r + 1]]``):

1. ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == total``;
2. every entry ``>= -1`` with padding allowed (``-1`` = padding), else ``>= 0``;
3. with ``lens [n]`` given, every valid entry ``< ceil(lens[r] / block_size)``;
4. the valid entries of each (head, row) segment strictly ascending (sorted, unique);
5. with padding, the ``-1`` entries of a segment after its valid ones.

:func:`check_segments` raises ``ValueError`` naming the first entry that breaks a rule, or returns.
The native checker decides in one pass over the entries (a decode step's few hundred: about a
microsecond, where the plain path costs a dozen array ops); when it finds a broken rule, or its
library is unavailable, or the tensors are not CPU int32, the plain path runs and names the entry.

``plan`` (:func:`~.plan.check_segments`: the native kernel where it takes the inputs and
its library builds, else the twin), ``native`` + ``segment_check.c`` (the C kernel behind ctypes),
``naive`` (the plain twin).
"""
