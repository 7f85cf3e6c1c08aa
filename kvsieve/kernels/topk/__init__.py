"""Exact per-row top-k: the one dispatch predicate (``plan.choose_topk_engine``, ``run_topk``),
the Triton ``radix`` and ``gvr`` engines (``triton``), the CuTe-DSL GVR engine (``cute``) and the
plain-PyTorch references of every engine and the ``torch`` engine (``naive``)."""
