"""Fixtures of the CuTe-DSL kernel tests.

``compiled_variants`` compiles every shipped attention kernel variant once per session for sm_90a
and sm_100a (two child processes at a time; about 100 s on 2 cores), ``compiled_topk`` the GVR
top-k variants; both are skipped with the reason when nvidia-cutlass-dsl is not importable.
"""
from __future__ import annotations

import pytest

from kvsieve.kernels.common.cute import cute_available


@pytest.fixture(scope="session")
def compiled_variants(tmp_path_factory):
    ok, why = cute_available()
    if not ok:
        pytest.skip(f"compile checks need nvidia-cutlass-dsl: {why}")
    from kvsieve.kernels.aot.cute_report import compile_all, variants

    reports = compile_all(str(tmp_path_factory.mktemp("cute_compile")), jobs=2, specs=variants())
    return {(r.name.rsplit("_", 1)[0], r.arch): r for r in reports}


@pytest.fixture(scope="session")
def compiled_topk(tmp_path_factory):
    """The GVR top-k variants (k 512/1024/2048, sm_90a and sm_100a), compiled once per session
    (six child processes, two at a time; about 20 s on 2 cores): ``{(k, arch): CompileReport}``."""
    ok, why = cute_available()
    if not ok:
        pytest.skip(f"compile checks need nvidia-cutlass-dsl: {why}")
    from kvsieve.kernels.aot.cute_report import compile_all, topk_variants

    specs = topk_variants()
    reports = compile_all(str(tmp_path_factory.mktemp("cute_topk_compile")), jobs=2, specs=specs)
    return {(s["k"], s["arch"]): r for s, r in zip(specs, reports)}
