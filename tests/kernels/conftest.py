"""Where the kernel tests run: compiled on the GPU when torch sees one, else under the Triton interpreter on CPU.

- The repository root goes first on sys.path: pytest's rootdir insertion puts tests/ there, where the folder
  tests/kernels would otherwise be imported as a namespace package named `kernels` in place of the real one.
- Without a CUDA device the interpreter is switched on here too (tests/conftest.py keys on the device files, which
  can exist while torch has no CUDA), before any test module imports a kernel.
- With one, every tensor the tests create lands on it, so the same comparisons run against the compiled kernels.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path[:1]:
    sys.path.insert(0, _REPO)

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
