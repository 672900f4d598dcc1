"""Rotary position embeddings (Def. 15, "Rotary Position Embedding", of the chapter "Deep Learning Building Blocks";
Prop. 1, "Relative Position Property of RoPE"; Remark 10, "RoPE in Practice") and 2-D RoPE for image tokens.

Tables. `rope_cos_sin` returns `cos, sin` of shape (P, D/2): entry [m, i] is cos/sin(m * theta_i) (times the YaRN
attention factor when one applies). Half-width tables serve both pairings of the head dimension:
- "rotate-half" (HF Llama/Mistral/Qwen2, the default): pair i is (x_i, x_{i + D/2});
- interleaved (the chapter's block-diagonal R_Theta,m, RoFormer, GPT-J): pair i is (x_{2i}, x_{2i+1}).
Each pair is rotated by the standard planar rotation [[cos a, -sin a], [sin a, cos a]] (the chapter prints the
second row's cos with a stray minus sign, which would make R a reflection;
Prop. 1, "Relative Position Property of RoPE", needs a rotation).

Frequency schedule theta_i = base^{-2(i-1)/d} (the chapter's equation ROPE FREQ) and the scalings of Remark 10
("RoPE in Practice"), numerically identical to Hugging Face transformers' `rope_type`s: "linear" (position
interpolation), "ntk" (NTK-aware base change), "dynamic" (HF's dynamic NTK: the base grows with the table length),
"yarn" (Peng et al. 2023), "llama3" and "longrope" (Ding et al. 2024, LongRoPE; Phi-3): per-frequency rescale factors,
the short set for positions inside the original context and the long set past it. transformers picks the set per
forward pass, by its last position: a prompt longer than the original context is rotated with the long set at every
position, and each later token by its own position. `RoPE.long_prompt_from` and `long_tables` give that rule per
sequence (the engine's batch marks the prompt tokens of such sequences), so a token's rotation depends on its
sequence's prompt, never on the batch or the chunking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

SCALING_TYPES = ("linear", "ntk", "dynamic", "yarn", "llama3", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling for context extension (Remark 10, "RoPE in Practice"); field names follow HF's
    `rope_scaling` dict."""

    type: str
    factor: float
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # longrope: one factor per frequency (D/2 each)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.type not in SCALING_TYPES:
            raise ValueError(f"type: unknown RoPE scaling {self.type!r}; expected one of {SCALING_TYPES}")
        if self.factor <= 0:
            raise ValueError(f"factor must be positive, got {self.factor}")
        if self.type == "longrope" and not (self.short_factor and len(self.short_factor) == len(self.long_factor)):
            raise ValueError("short_factor and long_factor: longrope needs both, of equal length (head_dim / 2)")
        if self.type in ("dynamic", "yarn", "llama3", "longrope") and self.original_max_position_embeddings is None:
            raise ValueError(f"original_max_position_embeddings is required for {self.type!r} scaling")

    @classmethod
    def from_hf(cls, d: dict[str, Any] | None, max_position_embeddings: int | None = None) -> RopeScaling | None:
        """Build from an HF `rope_scaling` / `rope_parameters` dict (keys `rope_type` or `type`); None for default."""
        if not d:
            return None
        kind = d.get("rope_type", d.get("type", "default"))
        if kind == "default":
            return None
        known = {f.name for f in fields(cls)} - {"type"}
        kw = {key: tuple(val) if isinstance(val, list) else val for key, val in d.items()
              if key in known and val is not None}
        kw.setdefault("original_max_position_embeddings", max_position_embeddings)
        if kind == "longrope" and "factor" not in kw:
            # Phi-3 states the extension as max_position_embeddings / original_max_position_embeddings
            kw["factor"] = (max_position_embeddings or kw["original_max_position_embeddings"]) / \
                kw["original_max_position_embeddings"]
        return cls(type=kind, **kw)


def rope_inv_freq(head_dim: int, theta: float | torch.Tensor = 10000.0) -> torch.Tensor:
    """theta_i = theta^{-2i/d}, i = 0 .. d/2 - 1 (equation ROPE FREQ), float32, (D/2,)."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by 1/factor, keep high ones, blend on a linear ramp between them."""
    if s.attention_factor is not None:
        attn_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attn_factor = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attn_factor = _yarn_mscale(s.factor)

    def correction_dim(n_rotations: float) -> float:
        # the dimension whose wavelength fits n_rotations times into the original context
        return (
            head_dim
            * math.log(s.original_max_position_embeddings / (n_rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 - ramp  # 1 keeps the original frequency, 0 interpolates it fully
    base = rope_inv_freq(head_dim, theta)
    inv_freq = (base / s.factor) * (1 - extrapolation) + base * extrapolation
    return inv_freq, float(attn_factor)


def _llama3(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: divide long wavelengths by factor, keep short ones, smooth in between."""
    inv_freq = rope_inv_freq(head_dim, theta)
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_attention_factor(s: RopeScaling) -> float:
    """sqrt(1 + ln(s) / ln(L_orig)) for an extension s > 1 (LongRoPE, as Phi-3 uses it), unless the config sets one."""
    if s.attention_factor is not None:
        return s.attention_factor
    return 1.0 if s.factor <= 1 else math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))


def scaled_inv_freq(
    head_dim: int, theta: float = 10000.0, scaling: RopeScaling | None = None, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq (D/2,), attention_factor) for the given scaling; `seq_len` only matters for "dynamic"."""
    if scaling is None:
        return rope_inv_freq(head_dim, theta), 1.0
    s = scaling
    if s.type == "linear":
        return rope_inv_freq(head_dim, theta) / s.factor, 1.0
    if s.type == "ntk":
        return rope_inv_freq(head_dim, theta * s.factor ** (head_dim / (head_dim - 2))), 1.0
    if s.type == "dynamic":
        original = s.original_max_position_embeddings
        n = max(seq_len or original, original)
        # float32 tensor arithmetic like HF, so tables agree to the last bit rather than to ~1e-5
        base = theta * ((s.factor * torch.tensor(n) / original) - (s.factor - 1)) ** (head_dim / (head_dim - 2))
        return rope_inv_freq(head_dim, base), 1.0
    if s.type == "yarn":
        return _yarn(head_dim, theta, s)
    if s.type == "longrope":
        long = seq_len is not None and seq_len > s.original_max_position_embeddings
        factors = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (factors * theta**exponent), _longrope_attention_factor(s)  # HF's order of operations
    return _llama3(head_dim, theta, s), 1.0


def rope_cos_sin(
    head_dim: int,
    positions: int | torch.Tensor,
    theta: float = 10000.0,
    scaling: RopeScaling | dict[str, Any] | None = None,
    long: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (P, D/2) float32 for `positions` (a tensor of positions, or an int P meaning 0..P-1).

    For "dynamic" scaling the number of positions plays HF's current sequence length. `long` (longrope): the long
    factors at every position, for a prompt past the original context; else each position's own set.
    """
    if isinstance(scaling, dict):
        scaling = RopeScaling.from_hf(scaling)
    pos = torch.arange(positions) if isinstance(positions, int) else positions
    seq_len = int(pos.max()) + 1 if pos.numel() else 0
    if scaling is not None and scaling.type == "longrope" and long:
        seq_len = scaling.original_max_position_embeddings + 1
    elif scaling is not None and scaling.type == "longrope":
        short, attn_factor = scaled_inv_freq(head_dim, theta, scaling, None)
        long, _ = scaled_inv_freq(head_dim, theta, scaling, scaling.original_max_position_embeddings + 1)
        inside = (pos < scaling.original_max_position_embeddings)[..., None]
        angles = pos.float()[..., None] * torch.where(inside, short.to(pos.device), long.to(pos.device))
        return angles.cos() * attn_factor, angles.sin() * attn_factor
    inv_freq, attn_factor = scaled_inv_freq(head_dim, theta, scaling, seq_len)
    angles = pos.float()[..., None] * inv_freq.to(pos.device)  # (P, D/2)
    return angles.cos() * attn_factor, angles.sin() * attn_factor


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, Hq, T, D) and k (B, Hk, T, D) by R_Theta,m (equation ROPE QK); returns new tensors.

    cos/sin are (P, D/2) tables. With `positions` ((T,) or (B, T) ints) rows are gathered from the tables; without,
    tokens take rows 0..T-1 (as genserve.kernels.apply_rope does), or the tables already hold one row per token (B, T,
    D/2).
    """
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    elif cos.dim() == 2:
        cos, sin = cos[: q.shape[-2]], sin[: q.shape[-2]]
    if cos.dim() == 3:  # (B, T, D/2) -> (B, 1, T, D/2), shared by every head
        cos, sin = cos[:, None], sin[:, None]
    return _rotate(q, cos, sin, interleaved), _rotate(k, cos, sin, interleaved)


def rope_matrix(head_dim: int, position: float, theta: float = 10000.0) -> torch.Tensor:
    """The block-diagonal R_Theta,m of (ROPE) as a dense (D, D) float64 matrix, interleaved-pair layout."""
    inv_freq = rope_inv_freq(head_dim, theta).double()
    r = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    for i, f in enumerate(inv_freq):
        c, s = torch.cos(position * f), torch.sin(position * f)
        r[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.stack((torch.stack((c, -s)), torch.stack((s, c))))
    return r


def rope_2d(head_dim: int, height: int, width: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D RoPE for a height x width grid of image tokens (as in DiT-style models): cos, sin (H*W, D/2).

    Half of the rotation pairs use the row index and half the column index, each with its own RoPE schedule over
    D/2 dims, so a score depends only on (row_m - row_n, col_m - col_n). Tokens are flattened row-major; apply with
    `apply_rope(q, k, cos, sin)` (no positions).
    """
    if head_dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4 for 2-D RoPE, got {head_dim}")
    rows = torch.arange(height).repeat_interleave(width)
    cols = torch.arange(width).repeat(height)
    cos_r, sin_r = rope_cos_sin(head_dim // 2, rows, theta)
    cos_c, sin_c = rope_cos_sin(head_dim // 2, cols, theta)
    return torch.cat((cos_r, cos_c), dim=-1), torch.cat((sin_r, sin_c), dim=-1)


class RoPE(nn.Module):
    """Holds the cos/sin tables (non-persistent buffers, so checkpoints never carry them) for positions 0..P-1."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float = 10000.0,
        scaling: RopeScaling | dict[str, Any] | None = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim, self.theta, self.interleaved = head_dim, theta, interleaved
        cos, sin = rope_cos_sin(head_dim, max_position, theta, scaling)
        self.register_buffer("cos", cos, persistent=False)  # (P, D/2)
        self.register_buffer("sin", sin, persistent=False)
        if isinstance(scaling, dict):
            scaling = RopeScaling.from_hf(scaling)
        # longrope: a prompt longer than this is rotated with the long factors at every position (module docstring)
        self.long_prompt_from = 0
        if scaling is not None and scaling.type == "longrope":
            self.long_prompt_from = scaling.original_max_position_embeddings
            long_cos, long_sin = rope_cos_sin(head_dim, max_position, theta, scaling, long=True)
            self.register_buffer("long_cos", long_cos, persistent=False)  # (P, D/2)
            self.register_buffer("long_sin", long_sin, persistent=False)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin

    def long_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """longrope's long factors at every position (for the prompts past `long_prompt_from`)."""
        return self.long_cos, self.long_sin

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, k, self.cos, self.sin, positions, self.interleaved)
