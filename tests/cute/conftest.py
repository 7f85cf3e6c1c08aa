"""Fixtures of the CuTe-DSL kernel tests.

``compiled_variants`` compiles every shipped kernel variant once per session for sm_90a and
sm_100a (two child processes at a time; about 100 s on 2 cores) and is skipped with the reason
when nvidia-cutlass-dsl is not importable.
"""
from __future__ import annotations

import pytest

from kvsieve.kernels.cute._common import cute_available


@pytest.fixture(scope="session")
def compiled_variants(tmp_path_factory):
    ok, why = cute_available()
    if not ok:
        pytest.skip(f"compile checks need nvidia-cutlass-dsl: {why}")
    from kvsieve.kernels.cute.report import compile_all

    reports = compile_all(str(tmp_path_factory.mktemp("cute_compile")), jobs=2)
    return {(r.name.rsplit("_", 1)[0], r.arch): r for r in reports}
