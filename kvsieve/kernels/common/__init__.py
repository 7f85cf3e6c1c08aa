"""Pieces shared by several kernel ops (an op never imports another op; ops import from here, and
nothing here imports an op):

* ``checks``: shape/dtype argument checks of the kernels and their references;
* ``launch``: the Triton launch tables and arch detection;
* ``native`` (+ ``include/``): building and loading the native CPU kernels' C sources;
* ``cute``, ``cute_bundle``: CuTe-DSL availability/arch, and running from an ahead-of-time bundle;
* ``indexing``: request-local selections to physical slots, effective attended tokens;
* ``merge_states``: the split-K merge (Triton kernel and reference);
* ``gather``: the paged gather attention (plan, Triton kernel, reference, CuTe kernel) behind the
  GQA decode, the MLA decode and the sparse prefill.
"""
