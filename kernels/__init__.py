"""Kernels for the text LM: Triton on GPUs, C on CPUs.

- Triton (GPU): flash attention (prefill), paged decode attention, fused RMSNorm, RoPE. On machines without a GPU
  they run under TRITON_INTERPRET=1 (tests only; the services use torch there).
- C (CPU, csrc/, built on first use by _cpu_library.py): `cpu_gemv` (decode-sized matrix products),
  `cpu_paged_decode` (paged decode attention) and `cpu_decode_layer` (a whole decoder layer for decode tokens).

Model code never imports this package: `shared/blocks/backend.py` calls the per-op kernels, and the text engine
(`services/text/cpu_decode.py`) the fused layer.
"""

from kernels.flash_attention import flash_attention
from kernels.paged_attention import paged_decode_attention
from kernels.rms_norm import rms_norm
from kernels.rope import apply_rope

__all__ = ["apply_rope", "flash_attention", "paged_decode_attention", "rms_norm"]
