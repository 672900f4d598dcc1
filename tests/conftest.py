"""Test-wide setup: the repository root on sys.path for `tests.*` and `bench.*`, the Triton interpreter on CPU-only
machines, and seeded RNGs for every test."""

import os
import random
import sys
from pathlib import Path

# Appended, never first: the root's folders (kernels/, services/, shared/) are genserve's packages only under the
# `genserve.` names, and must not shadow an installed distribution of the same top-level name (Hugging Face's
# `kernels`, which transformers imports). `make test` runs pytest with -P, so the working directory is not first either.
sys.path.append(str(Path(__file__).resolve().parents[1]))

# Read when @triton.jit decorates a kernel, so it must be set before any kernel module is imported.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


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
