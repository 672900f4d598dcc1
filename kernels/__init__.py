"""Kernels: Triton on GPUs, C (and prepared oneDNN calls) on CPUs.

- Triton (GPU): flash attention (prefill; soft-capping and sinks), paged decode attention, multi-head latent
  attention's absorbed decode over its latent cache (mla_decode), fused RMSNorm, RoPE, the
  matmul with GGUF Q8_0/Q4_0/Q4_1 weights dequantised in registers (quant_matmul), and the mixture-of-experts FFN as
  two grouped GEMMs over expert-sorted rows (fused_moe). On machines without a GPU they run under
  TRITON_INTERPRET=1 (tests only; the services use torch there).
- C (CPU, csrc/, built on first use by _cpu_library.py): `cpu_gemv` (decode-sized matrix products),
  `cpu_paged_decode` (paged decode attention), `cpu_quant` (products with GGUF Q8_0/Q4_0/Q4_1 weights, dequantised
  in registers), `cpu_decode_step` (a whole text decode step: every layer, the final norm and the LM head) and
  `cpu_group_norm` (GroupNorm + SiLU for the image models).
- `cpu_conv`: small convolutions on oneDNN with the weight reordered once, not on every call.

- `quant_formats`: GGUF's block layouts and the torch dequantiser that every quantised kernel is checked against.

Model code reaches the kernels through `shared/blocks/backend.py` (the per-op kernels) and the text engine's CPU
runner (`services/text/runners/cpu.py`, the fused step); the blocks import only `quant_formats` directly, for the
layouts. Nothing here imports `genserve.shared` or `genserve.services` (tests/test_package_layers.py).
"""

from genserve.kernels.flash_attention import flash_attention
from genserve.kernels.mla_decode import mla_decode_attention
from genserve.kernels.paged_attention import paged_decode_attention
from genserve.kernels.quant_matmul import quant_linear
from genserve.kernels.rms_norm import rms_norm
from genserve.kernels.rope import apply_rope

__all__ = ["apply_rope", "flash_attention", "mla_decode_attention", "paged_decode_attention", "quant_linear",
           "rms_norm"]
