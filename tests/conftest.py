"""Test-wide setup: the repository root on sys.path for `tests.*` and `bench.*`, where the Triton kernels run (the
interpreter unless compiled kernels are asked for), and seeded RNGs for every test."""

import os
import random
import sys
from pathlib import Path

# Appended, never first: the root's folders (kernels/, services/, shared/) are genserve's packages only under the
# `genserve.` names, and must not shadow an installed distribution of the same top-level name (Hugging Face's
# `kernels`, which transformers imports). `make test` runs pytest with -P, so the working directory is not first either.
sys.path.append(str(Path(__file__).resolve().parents[1]))

# TRITON_INTERPRET is read when @triton.jit decorates a kernel, so one process runs either interpreted or compiled
# kernels, never both. Several tests force the Triton backend on CPU tensors (test_text_runners.py, test_backend.py),
# which only the interpreter can run, so it is on unless a run asks for compiled kernels with TRITON_INTERPRET=0:
# bench/gpu_check.py does that for its `pytest -m gpu` row. A GPU in the machine changes nothing here
# (tests/test_interpreter_on_a_gpu_machine.py runs the suite's interpreter-forced tests with one faked present).
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

COMPILED_KERNELS = os.environ["TRITON_INTERPRET"] in ("", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests time and compare the compiled kernels at production sizes: under the interpreter they are skipped,
    with the command that runs them."""
    if COMPILED_KERNELS:
        return
    skip = pytest.mark.skip(reason="compiled kernels only: TRITON_INTERPRET=0 pytest -m gpu (bench/gpu_check.py)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a parameter id such as [gpu]
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def cpu_kernels():
    """The C kernels, loaded. Skips only where they cannot exist (no C compiler, or GENSERVE_CPU_KERNELS=off);
    where a compiler exists a failed build fails the test, so a broken build never shows green."""
    from genserve.kernels import _cpu_library

    lib = _cpu_library.library()
    if lib is None:
        status = _cpu_library.status()
        if _cpu_library.compiler() is None or status.reason.startswith("disabled"):
            pytest.skip(f"CPU kernels unavailable here: {status.reason}")
        pytest.fail(f"a C compiler exists but the CPU kernels did not build: {status.reason}")
    return lib
