"""2-D convolution for CPU inference on oneDNN, with the weight reordered once into its blocked layout; and the
dispatch rule that keeps a batch's images independent of each other (batch invariance).

``F.conv2d`` hands oneDNN the plain (O, I, kH, kW) weight, which it reorders into its blocked layout on every call.
On the outputs of a diffusion U-Net at latent size (2 x 8 x 8 and 2 x 4 x 4 pixels, 64-256 channels) that reorder
costs as much as a fifth to a third of the convolution, and 1x1 convolutions fall back to a slower non-oneDNN path
altogether. ``conv2d`` reorders once per weight version and input shape
(``torch.ops.mkldnn._reorder_convolution_weight``, the op torch's own inductor uses for frozen CPU graphs) and runs
the same oneDNN primitive on the prepared weight.

Batch invariance: ``F.conv2d`` picks its algorithm from the batch size (im2col + GEMM for one image, a non-oneDNN
path for 1x1 kernels under 16 images on one thread, oneDNN otherwise), and the three round differently, so an
image's pixels changed with the number of images it was computed with (up to 4e-6, enough to flip PNG bytes). The
choice here depends on one image's geometry only: the prepared path when one image has at most MAX_PIXELS output
pixels, ``torch.mkldnn_convolution`` (oneDNN, weight reordered per call) for larger images. Both run every image of
the batch through the same oneDNN kernel, so a batched image is bit-identical to the same image alone
(tests/kernels/test_cpu_conv.py; that is what lets the gan and vae apps merge requests, docs/deploy.md). On a
shared 2-core EPYC, one thread, min of 5-7 runs, convolutions alone changed: the demo GAN 6.1 ms for 1 image and
79 ms for 32 (the batch-size rule it replaces: 6.4 and 105 ms), the demo VAE's Reconstruct 21 / 326 ms (before: 20 /
562 ms).
"""

from __future__ import annotations

import functools

import torch

MAX_PIXELS = 512  # H_out * W_out of one image; see the module docstring
PACKED_SHAPES = 8  # input shapes (batch sizes, mostly) whose reordered weight one module keeps


@functools.cache
def _available() -> bool:
    # private ops (torch's inductor uses them for frozen CPU graphs): checked, so a build without them keeps F.conv2d
    return torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.mkldnn, op) for op in ("_convolution_pointwise", "_reorder_convolution_weight"))


def onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True for fp32 (B, C, H, W) CPU inputs when this torch build has oneDNN: the batch-invariant paths apply."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 4
            and _available())


def supports(x: torch.Tensor, weight: torch.Tensor, stride: tuple[int, int], padding: tuple[int, int]) -> bool:
    """True when ``conv2d`` applies: ``onednn``, at most MAX_PIXELS output pixels per image (never a rule on the
    batch size), and a weight that tracks versions (one created under inference_mode does not, so it is never
    cached)."""
    if not onednn(x, weight) or weight.is_inference():
        return False
    h = (x.shape[2] + 2 * padding[0] - weight.shape[2]) // stride[0] + 1
    w = (x.shape[3] + 2 * padding[1] - weight.shape[3]) // stride[1] + 1
    return 0 < h * w <= MAX_PIXELS


def unprepared(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, int],
               padding: tuple[int, int]) -> torch.Tensor:
    """F.conv2d(x, weight, bias, stride, padding) on oneDNN whatever the batch size (``onednn`` first)."""
    return torch.mkldnn_convolution(x, weight, bias, list(padding), list(stride), [1, 1], 1)


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: tuple[int, int],
           padding: tuple[int, int], cache: dict) -> torch.Tensor:
    """F.conv2d(x, weight, bias, stride, padding) (dilation 1, groups 1), forward only; check ``supports`` first.

    ``cache`` is the caller's store for the reordered weight (one module's); it is emptied whenever the weight's
    storage or version changes, so an in-place weight update is never computed with stale values. The weight is
    reordered for the input's shape: reordered without one, it did not match the layout oneDNN picks for the
    convolution, which then reordered it again on every call (on a 2-core AVX2 EPYC, 3.1 ms instead of 0.20 ms for
    2 x 64 x 8 x 8, 8.2 ms instead of 0.26 ms for 2 x 128 x 4 x 4). The same image gives the same bits whatever
    batch it comes in (tests/kernels/test_cpu_conv.py). The last PACKED_SHAPES input shapes keep their weight."""
    key = (weight.data_ptr(), weight._version, tuple(weight.shape), stride, padding)
    if cache.get("key") != key:
        cache.clear()
        cache["key"] = key
        cache["packed"] = {}
    packed: dict[tuple[int, ...], torch.Tensor] = cache["packed"]
    shape = tuple(x.shape)
    if shape not in packed:
        if len(packed) >= PACKED_SHAPES:
            del packed[next(iter(packed))]
        packed[shape] = torch.ops.mkldnn._reorder_convolution_weight(weight, list(padding), list(stride), [1, 1], 1,
                                                                     list(shape))
    # The answer is channels-last (oneDNN's native layout for these shapes): the U-Net's GroupNorm kernel reads it
    # as is, and torch's elementwise ops and F.conv2d accept it.
    return torch.ops.mkldnn._convolution_pointwise(x, packed[shape], bias, list(padding), list(stride), [1, 1], 1,
                                                   "none", [], "")
