"""Triton kernels for the text LM on GPUs: flash attention (prefill), paged decode attention, fused RMSNorm, RoPE.

Model code never imports this package: `shared/blocks/backend.py` is the one dispatch point that calls it.
On machines without a GPU the kernels run under TRITON_INTERPRET=1 (tests only; the services use torch there).
"""

from kernels.flash_attention import flash_attention
from kernels.paged_attention import paged_decode_attention
from kernels.rms_norm import rms_norm
from kernels.rope import apply_rope

__all__ = ["apply_rope", "flash_attention", "paged_decode_attention", "rms_norm"]
