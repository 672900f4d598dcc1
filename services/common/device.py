"""Where a replica computes: the GPU Ray gave it (``num_gpus`` in the deploy config), else the CPU; and with how many
CPU threads."""

from __future__ import annotations

import sys

import torch


class NoGpuError(RuntimeError):
    """A replica was given a GPU but torch cannot use one: serving on the CPU instead would be silently slow."""


def assigned_gpus() -> list[str]:
    """The GPU ids Ray assigned this process (``num_gpus`` > 0 in its deploy config); none outside a Ray worker.
    Ray is only looked up, never imported: a process that has not imported it (a bench, the GPU check) is no replica."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return []
    return [str(i) for i in ray.get_gpu_ids()]


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    try:
        torch.cuda.init()  # raises with the driver's own words (no device, or a driver older than the wheel's CUDA)
    except Exception as exc:  # any failure: its message is the diagnosis
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) cannot use it: {exc}"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees {torch.cuda.device_count()} devices"


def serving_device() -> torch.device:
    """CUDA when this process sees a GPU; the CPU when it was given none. A replica given a GPU that torch cannot use
    (no device visible, a driver older than the wheel's CUDA, a CPU build of torch) raises NoGpuError rather than
    serving on the CPU. Ray sets CUDA_VISIBLE_DEVICES per replica."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    gpus = assigned_gpus()
    if gpus:
        raise NoGpuError(f"this replica was given GPU {','.join(gpus)} (num_gpus in the serve config) but "
                         f"{_why_no_cuda()}; refusing to serve on the CPU. Install a torch build whose CUDA the "
                         "node's driver supports, or deploy with num_gpus: 0 (deploy/serve_config.local.yaml).")
    return torch.device("cpu")


def use_torch_threads(threads: int | None) -> None:
    """Intra-op threads of torch and of the C kernels (which take torch's count) in this replica. Ray starts every
    replica with OMP_NUM_THREADS = floor(num_cpus), at least 1, so a replica given a fraction of a core computes on
    one thread whatever the machine has; the serve config's ``torch_threads`` sets it instead (None: Ray's)."""
    if threads is not None:
        torch.set_num_threads(threads)
