"""2-D convolution for small CPU inference batches, with the weight reordered once into oneDNN's blocked layout.

``F.conv2d`` hands oneDNN the plain (O, I, kH, kW) weight, which it reorders into its blocked layout on every call.
On the outputs of a diffusion U-Net at latent size (2 x 8 x 8 and 2 x 4 x 4 pixels, 64-256 channels) that reorder
costs as much as a fifth to a third of the convolution, and 1x1 convolutions fall back to a slower non-oneDNN path
altogether. ``conv2d`` reorders once per weight version (``torch.ops.mkldnn._reorder_convolution_weight``, the op
torch's own inductor uses for frozen CPU graphs) and runs the same oneDNN primitive on the prepared weight.

Past about 512 output pixels per call the plain path is as fast or faster (measured on a 2-core EPYC, 1 and 2
threads: 20-30% faster prepared at 32-128 pixels, even at 512, 10-20% slower at 1024-4096), so larger calls keep
``F.conv2d``. So do single images: for a batch of one, ``F.conv2d`` takes torch's own im2col + GEMM path rather
than oneDNN, and inside the VAE that path ran these sizes faster (49 against 84 µs per conv on average over the
encoder's 13 small convolutions); and so do the tiniest convolutions (under MIN_FLOPS), where a oneDNN call's fixed
~20 µs is several times the work.
"""

from __future__ import annotations

import functools

import torch

MAX_PIXELS = 512  # B * H_out * W_out; see the module docstring
MIN_FLOPS = 2**18  # 2 * B * H_out * W_out * C_out * C_in * kH * kW


@functools.cache
def _available() -> bool:
    # private ops (torch's inductor uses them for frozen CPU graphs): checked, so a build without them keeps F.conv2d
    return torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.mkldnn, op) for op in ("_convolution_pointwise", "_reorder_convolution_weight"))


def supports(x: torch.Tensor, weight: torch.Tensor, stride: tuple[int, int], padding: tuple[int, int]) -> bool:
    """True when ``conv2d`` applies: fp32 CPU tensors, a (B, C, H, W) input with B >= 2, at most MAX_PIXELS output
    pixels and at least MIN_FLOPS, and a weight that tracks versions (one created under inference_mode does not,
    so it is never cached)."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() != 4
            or x.shape[0] < 2 or weight.is_inference()):
        return False
    h = (x.shape[2] + 2 * padding[0] - weight.shape[2]) // stride[0] + 1
    w = (x.shape[3] + 2 * padding[1] - weight.shape[3]) // stride[1] + 1
    pixels = x.shape[0] * h * w
    return 0 < pixels <= MAX_PIXELS and 2 * pixels * weight.numel() >= MIN_FLOPS and _available()


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, int],
           padding: tuple[int, int], cache: dict) -> torch.Tensor:
    """F.conv2d(x, weight, bias, stride, padding) (dilation 1, groups 1), forward only; check ``supports`` first.

    ``cache`` is the caller's store for the reordered weight (one entry per module); it is refreshed whenever the
    weight's storage or version changes, so an in-place weight update is never computed with stale values."""
    key = (weight.data_ptr(), weight._version, tuple(weight.shape), stride, padding)
    if cache.get("key") != key:
        cache.clear()
        cache["packed"] = torch.ops.mkldnn._reorder_convolution_weight(weight, list(padding), list(stride), [1, 1], 1)
        cache["key"] = key
    # The answer is channels-last (oneDNN's native layout for these shapes): the U-Net's GroupNorm kernel reads it
    # as is, and torch's elementwise ops and F.conv2d accept it.
    return torch.ops.mkldnn._convolution_pointwise(x, cache["packed"], bias, list(padding), list(stride), [1, 1], 1,
                                                   "none", [], "")
