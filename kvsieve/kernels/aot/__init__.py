"""Ahead-of-time compilation of the kernels, no GPU needed: the resource reports
(``python -m kvsieve.kernels.aot.triton_report``, ``... .dsa_report``, ``... .cute_report``; drivers
``triton_compile`` and ``cute_compile``) and the CuTe-DSL bundle builder
(``python -m kvsieve.kernels.aot.cute_bundle build``). Nothing at run time imports this package."""
