"""The interpreter stack that is known to break (triton < 3.8 with numpy >= 2.4: a TypeError deep in
the interpreter) is refused by name before any kernel runs; the stacks seen working pass."""
from __future__ import annotations

import pytest

from kvsieve.kernels.common.launch import check_interpreter


@pytest.mark.parametrize("triton_v,numpy_v", [("3.6.0", "2.4.6"), ("3.7.1", "2.5.2")])
def test_broken_interpreter_stack_refused(triton_v, numpy_v):
    with pytest.raises(RuntimeError, match=rf"triton {triton_v}'s interpreter fails with numpy {numpy_v}.*numpy<2.4"):
        check_interpreter(triton_v, numpy_v)


@pytest.mark.parametrize("triton_v,numpy_v", [("3.6.0", "2.3.5"), ("3.8.0", "2.4.6"), ("3.9.0", "2.4.6")])
def test_working_stacks_pass(triton_v, numpy_v):
    check_interpreter(triton_v, numpy_v)
