"""Test-wide setup: the Triton interpreter on CPU-only machines, and seeded RNGs for every test."""

import os
import random

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
