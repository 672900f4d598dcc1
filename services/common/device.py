"""Where a replica computes: the GPU Ray gave it (``num_gpus`` in the deploy config), else the CPU; and with how many
CPU threads."""

from __future__ import annotations

import torch


def serving_device() -> torch.device:
    """CUDA when this process sees a GPU, CPU otherwise; Ray sets CUDA_VISIBLE_DEVICES per replica."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def use_torch_threads(threads: int | None) -> None:
    """Intra-op threads of torch and of the C kernels (which take torch's count) in this replica. Ray starts every
    replica with OMP_NUM_THREADS = floor(num_cpus), at least 1, so a replica given a fraction of a core computes on
    one thread whatever the machine has; the serve config's ``torch_threads`` sets it instead (None: Ray's)."""
    if threads is not None:
        torch.set_num_threads(threads)
