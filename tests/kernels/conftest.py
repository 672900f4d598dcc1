"""Where the kernel tests run: under the Triton interpreter on CPU tensors (tests/conftest.py turns it on), or, in a
run that asks for compiled kernels (TRITON_INTERPRET=0) on a machine with a GPU, on CUDA tensors: every tensor the
tests create then lands on the GPU, so the same comparisons run against the compiled kernels."""

import pytest
import torch

from genserve.kernels._runtime import interpreting


@pytest.fixture(autouse=True)
def _tensors_on_the_kernel_device():
    if interpreting() or not torch.cuda.is_available():
        yield
        return
    torch.set_default_device("cuda")
    yield
    torch.set_default_device(None)
