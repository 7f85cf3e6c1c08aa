"""The paged gather attention shared by several ops: split-K online softmax over selected or dense
positions of a paged cache, used by ``sparse_gqa_decode``, ``paged_prefill``'s sparse path and
``sparse_mla_decode``. ``plan`` (the launch plan both walks share), ``triton`` (the kernel and its
tile steps), ``naive`` (its plain-PyTorch reference), ``cute`` (the SM90/SM100 CuTe-DSL kernel and
its host side, for the GQA and MLA CuTe decodes)."""
