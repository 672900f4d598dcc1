"""SD3's denoiser: the Multimodal Diffusion Transformer (MMDiT; Esser et al. 2024, "Scaling Rectified Flow
Transformers for High-Resolution Image Synthesis", §4 and Fig. 2), from diffusers' ``SD3Transformer2DModel`` folder
(``config.json`` + ``diffusion_pytorch_model.safetensors``), module names as diffusers' so the weights load 1:1.

    latents (B, 16, h, w) ─ 2×2 patches (conv) + cropped 2-D sin-cos positions ─▶ x (B, N, D)
    text tokens (B, T, 4096) ─ context_embedder ─▶ c (B, T, D)
    y = TimestepEmbed(t) + MLP(pooled text)   (the adaLN conditioning, B × D)
    L × JointTransformerBlock(x, c, y): per stream adaLN-Zero → joint attention → adaLN-Zero MLP
    AdaLN(final) → linear → un-patchify ─▶ velocity (B, 16, h, w)

The last block's text stream only feeds attention (``context_pre_only``). SD3.5's extra per-block self-attention
(``dual_attention_layers``) is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from genserve.services.diffusion.text_conditioning import gather
from genserve.shared.blocks.adaln import AdaLayerNormContinuous, AdaLayerNormZero, modulate
from genserve.shared.blocks.cross_attention import ContextCache
from genserve.shared.blocks.joint_attention import JointAttention
from genserve.shared.blocks.positions import TimestepEmbedding, timestep_embedding
from genserve.shared.checkpoint import load_state_strict, read_safetensors_dir, supported

CLASS_NAME = "SD3Transformer2DModel"
TIME_CHANNELS = 256  # the sinusoidal features of t before the MLP (diffusers' Timesteps(256))


@dataclass(frozen=True)
class MMDiTConfig:
    in_channels: int = 16
    out_channels: int = 16
    patch_size: int = 2
    n_layers: int = 24
    n_heads: int = 24
    head_dim: int = 64
    joint_attention_dim: int = 4096
    caption_projection_dim: int = 1536
    pooled_projection_dim: int = 2048
    pos_embed_max_size: int = 192
    sample_size: int = 128
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if min(self.in_channels, self.out_channels, self.patch_size, self.n_layers, self.n_heads, self.head_dim) < 1:
            raise ValueError("channels, patch_size, n_layers, n_heads and head_dim must be >= 1")
        if self.caption_projection_dim != self.dim:
            raise ValueError(f"caption_projection_dim ({self.caption_projection_dim}) must equal num_attention_heads x "
                             f"attention_head_dim ({self.dim})")

    @property
    def dim(self) -> int:
        return self.n_heads * self.head_dim

    @classmethod
    def from_diffusers(cls, raw: dict, where: str) -> MMDiTConfig:
        supported(raw, "dual_attention_layers", [], ([], ()), where)
        qk_norm = supported(raw, "qk_norm", None, (None, "rms_norm"), where)
        in_channels = int(raw.get("in_channels", 16))
        return cls(in_channels=in_channels, out_channels=int(raw.get("out_channels") or in_channels),
                   patch_size=int(raw.get("patch_size", 2)), n_layers=int(raw.get("num_layers", 18)),
                   n_heads=int(raw.get("num_attention_heads", 18)), head_dim=int(raw.get("attention_head_dim", 64)),
                   joint_attention_dim=int(raw.get("joint_attention_dim", 4096)),
                   caption_projection_dim=int(raw.get("caption_projection_dim", 1152)),
                   pooled_projection_dim=int(raw.get("pooled_projection_dim", 2048)),
                   pos_embed_max_size=int(raw.get("pos_embed_max_size", 96)),
                   sample_size=int(raw.get("sample_size", 128)), qk_norm=qk_norm == "rms_norm")


class GeluFeedForward(nn.Module):
    """net.2(GELU_tanh(net.0.proj(x))): diffusers' FeedForward(activation_fn="gelu-approximate"), 4× wide."""

    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        proj = nn.Module()
        proj.proj = nn.Linear(dim, mult * dim)
        self.net = nn.ModuleList([proj, nn.Identity(), nn.Linear(mult * dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](F.gelu(self.net[0].proj(x), approximate="tanh"))


class PatchEmbed(nn.Module):
    """(B, C, h, w) -> (B, h/p · w/p, D): a p×p stride-p conv, plus the centre crop of a fixed grid of 2-D sin-cos
    positions (``pos_embed``, stored in the checkpoint), so any size up to pos_embed_max_size patches works."""

    def __init__(self, c: MMDiTConfig) -> None:
        super().__init__()
        self.patch, self.max_size = c.patch_size, c.pos_embed_max_size
        self.proj = nn.Conv2d(c.in_channels, c.dim, c.patch_size, stride=c.patch_size)
        self.register_buffer("pos_embed", torch.zeros(1, c.pos_embed_max_size**2, c.dim))

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        h, w = latents.shape[-2] // self.patch, latents.shape[-1] // self.patch
        if max(h, w) > self.max_size:
            raise ValueError(f"the latents span {h}x{w} patches, more than pos_embed_max_size ({self.max_size})")
        top, left = (self.max_size - h) // 2, (self.max_size - w) // 2
        grid = self.pos_embed.view(1, self.max_size, self.max_size, -1)[:, top : top + h, left : left + w]
        return self.proj(latents).flatten(2).transpose(1, 2) + grid.reshape(1, h * w, -1)


class TimeTextEmbed(nn.Module):
    """y = MLP(sinusoid(t)) + MLP(pooled text): the vector every adaLN reads (Esser et al. 2024, Fig. 2a)."""

    def __init__(self, dim: int, pooled_dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(TIME_CHANNELS, dim)
        self.text_embedder = TimestepEmbedding(pooled_dim, dim)  # the same linear → SiLU → linear

    def time(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(timestep_embedding(t, TIME_CHANNELS).to(dtype))


class JointTransformerBlock(nn.Module):
    """One MMDiT block: both streams modulated by y (adaLN-Zero), one joint attention, then each stream's own MLP."""

    def __init__(self, c: MMDiTConfig, context_pre_only: bool) -> None:
        super().__init__()
        dim = c.dim
        self.context_pre_only = context_pre_only
        self.norm1 = AdaLayerNormZero(dim)
        self.norm1_context = AdaLayerNormContinuous(dim) if context_pre_only else AdaLayerNormZero(dim)
        self.attn = JointAttention(dim, c.n_heads, c.head_dim, qk_norm=c.qk_norm, context_pre_only=context_pre_only)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = GeluFeedForward(dim)
        if not context_pre_only:
            self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
            self.ff_context = GeluFeedForward(dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        nx, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, y)
        if self.context_pre_only:
            nc = self.norm1_context(c, y)
        else:
            nc, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(c, y)
        x_attn, c_attn = self.attn(nx, nc)
        x = x + gate_msa[:, None] * x_attn
        x = x + gate_mlp[:, None] * self.ff(modulate(self.norm2(x), shift_mlp, scale_mlp))
        if self.context_pre_only:
            return x, None
        c = c + c_gate_msa[:, None] * c_attn
        c = c + c_gate_mlp[:, None] * self.ff_context(modulate(self.norm2_context(c), c_shift_mlp, c_scale_mlp))
        return x, c


class MMDiT(nn.Module):
    """The pipeline's denoiser: ``forward(latents, timesteps, context, temb=None)`` like the U-Net's, where
    ``context`` is TextConditioning (services/diffusion/text_conditioning.py) and ``temb`` the timesteps' embedding
    from ``time_embed`` (the pooled text's is added here, per row)."""

    def __init__(self, config: MMDiTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.pos_embed = PatchEmbed(c)
        self.time_text_embed = TimeTextEmbed(c.dim, c.pooled_projection_dim)
        self.context_embedder = nn.Linear(c.joint_attention_dim, c.dim)
        self.transformer_blocks = nn.ModuleList(
            JointTransformerBlock(c, context_pre_only=i == c.n_layers - 1) for i in range(c.n_layers))
        self.norm_out = AdaLayerNormContinuous(c.dim)
        self.proj_out = nn.Linear(c.dim, c.patch_size**2 * c.out_channels)

    def time_embed(self, timesteps: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(S,) timesteps (1000 σ) -> (S, D): the timestep part of the conditioning y."""
        return self.time_text_embed.time(timesteps, dtype)

    def embed(self, latents: torch.Tensor, timesteps: torch.Tensor, context: ContextCache,
              temb: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(image tokens (B, N, D), text tokens (B, T, D), y (B, D))."""
        b = latents.shape[0]
        tokens, pooled, _ = gather(context)
        if temb is None:
            temb = self.time_embed(timesteps.expand(b) if timesteps.dim() == 0 else timesteps, latents.dtype)
        y = temb.expand(b, -1) + self.time_text_embed.text_embedder(pooled.to(latents.dtype))
        return self.pos_embed(latents), self.context_embedder(tokens.to(latents.dtype)), y

    def unpatchify(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(B, N, p·p·C) -> (B, C, h, w)."""
        p, co = self.config.patch_size, self.config.out_channels
        x = x.reshape(x.shape[0], h // p, w // p, p, p, co)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], co, h, w)

    def head(self, x: torch.Tensor, y: torch.Tensor, h: int, w: int) -> torch.Tensor:
        return self.unpatchify(self.proj_out(self.norm_out(x, y)), h, w)

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, context: ContextCache,
                temb: torch.Tensor | None = None) -> torch.Tensor:
        """latents (B, C, h, w), timesteps (B,) in [0, 1000] -> velocity (B, C, h, w)."""
        h, w = latents.shape[-2:]
        x, c, y = self.embed(latents, timesteps, context, temb)
        cache = getattr(context, "step_cache", None)  # FirstBlockCache (services/diffusion/step_cache.py) or None
        if cache is not None:
            return cache.run(self, x, c, y, lambda out: self.head(out, y, h, w))
        return self.head(self.run_blocks(x, c, y), y, h, w)

    def first_block(self, x: torch.Tensor, c: torch.Tensor, y: torch.Tensor, rotary=None):
        return self.transformer_blocks[0](x, c, y)

    def run_blocks(self, x: torch.Tensor, c: torch.Tensor, y: torch.Tensor, rotary=None, start: int = 0
                   ) -> torch.Tensor:
        """The image stream after blocks ``start``.. (the step cache runs block 0 itself)."""
        for block in self.transformer_blocks[start:]:
            x, c = block(x, c, y)
        return x


def load_mmdit(directory: str | Path, device: str | torch.device = "cpu") -> MMDiT:
    directory = Path(directory)
    where = str(directory / "config.json")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{where} not found")
    model = MMDiT(MMDiTConfig.from_diffusers(json.loads((directory / "config.json").read_text()), where))
    state = read_safetensors_dir(directory, ("diffusion_pytorch_model", "model"))
    load_state_strict(model, {k: v.float() for k, v in state.items()}, str(directory))
    return model.to(device).eval()
