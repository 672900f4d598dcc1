"""Where a replica computes: the GPU Ray gave it (``num_gpus`` in the deploy config), else the CPU."""

from __future__ import annotations

import torch


def serving_device() -> torch.device:
    """CUDA when this process sees a GPU, CPU otherwise; Ray sets CUDA_VISIBLE_DEVICES per replica."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
