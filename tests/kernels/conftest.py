"""Where the kernel tests run: compiled on the GPU when torch sees one, else under the Triton interpreter on CPU.

- Without a CUDA device the interpreter is switched on here too (tests/conftest.py keys on the device files, which
  can exist while torch has no CUDA), before any test module imports a kernel.
- With one, every tensor the tests create lands on it, so the same comparisons run against the compiled kernels.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _tensors_on_the_kernel_device():
    if not torch.cuda.is_available():
        yield
        return
    torch.set_default_device("cuda")
    yield
    torch.set_default_device(None)
