"""Page top-k of one decode token over a page-summary pool (Quest's ``bound`` and RocketKV's
``sign`` scoring), on the CPU: the native C kernel beside its plain-PyTorch ``naive`` twin.

Inputs:

* ``pool [num_blocks, Hkv, S, 2, D]`` bf16, fp32 (or fp8, naive only): per block, per KV head,
  ``S`` pages' ``(min, max)`` key summaries (``[..., 0, :]`` = min); page ``p`` of the request
  is sub-page ``p % S`` of block ``block_ids[p // S]``.
* ``block_ids [ceil(n_pages / S)]`` int64: the request's blocks in order.
* ``q [Hq, D]`` (any float dtype; ``Hq = Hkv * G``, query head ``j`` in KV group ``j // G``),
  with any channel filter already applied (zeroed channels).

Per KV head, per page: ``bound`` scores ``sum_d max(q_d min_d, q_d max_d)``
(``min(q,0) . min + max(q,0) . max``), ``sign`` scores ``q . k_hat`` with ``k_hat`` = max on the
channels where the group's summed query is positive and min elsewhere; times ``sm_scale``, a
softmax over the pages per query head, the mean over the group, the newest page
(``n_pages - 1``) set to 2.0 (it always wins), then the top ``k`` pages, ties to the lower page.

:func:`page_topk` returns ``PageTopK(indices [Hkv, k] int32 ascending, scores [Hkv, n_pages]
fp32, engine)``; ``engine`` is ``"native"`` or ``"naive"``. The native kernel reads the pool in
place (no gather, no fp32 copy); its fp32 sums run in another order and its ``exp`` is its own
(~1 ulp), so its scores match the naive ones to the fp32 rounding of the logits and the pages are
the same unless two scores are that close. It runs for CPU tensors, bf16/fp32 pools, ``D <= 256``, ``G <= 16``
when its library builds (:mod:`kvsieve.kernels.common.native`); otherwise the naive path runs.

:func:`page_topk_rows` does the same for the decode tokens of many requests in one native call
(their block tables as rows of one table) and returns their indices side by side; without the
library it runs :func:`page_topk` per row.

``plan`` (:func:`~.plan.page_topk`: the native kernel where it takes the inputs and
its library builds, else the twin), ``native`` + ``page_topk.c`` (the C kernel behind ctypes),
``naive`` (the plain twin).
"""
