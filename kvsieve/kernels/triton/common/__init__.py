"""Pieces shared by several Triton ops: the paged gather-attention kernel (``gather``: split-K
online softmax over selected or dense positions, used by ``sparse_gqa_decode``, ``paged_prefill``'s
sparse path and ``sparse_mla_decode``) and its plain-PyTorch reference (``naive``)."""
