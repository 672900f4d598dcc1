"""Flux's denoiser (Black Forest Labs 2024, FLUX.1: a rectified-flow transformer in the MMDiT family of Esser et al.
2024), from diffusers' ``FluxTransformer2DModel`` folder, module names as diffusers' so the weights load 1:1.

    latents (B, 16, h, w) ─ 2×2 packing ─▶ (B, h/2 · w/2, 64) ─ x_embedder ─▶ x (B, N, D)
    T5 tokens ─ context_embedder ─▶ c (B, T, D)
    y = MLP(sinusoid(1000 t)) [+ MLP(sinusoid(1000 g)): the distilled guidance] + MLP(pooled CLIP)
    L × double-stream block: per stream adaLN-Zero, joint attention [text, image] with QK-norm and 3-axis RoPE
    L' × single-stream block: one sequence [text, image], attention and MLP in parallel from one adaLN-Zero
    AdaLN(final) → linear → unpack ─▶ velocity (B, 16, h, w)

Positions enter only as rotary angles over three axes (shared/blocks/rope_axes.py): text tokens at (0, 0, 0), image
patch (i, j) at (0, i, j). The guidance embedding replaces classifier-free guidance for the guidance-distilled
models (FLUX.1-dev): one pass per step, with the scale as an input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from genserve.services.diffusion.mmdit import GeluFeedForward
from genserve.services.diffusion.text_conditioning import gather
from genserve.shared.blocks.adaln import AdaLayerNormContinuous, AdaLayerNormZero, AdaLayerNormZeroSingle, modulate
from genserve.shared.blocks.cross_attention import ContextCache
from genserve.shared.blocks.joint_attention import JointAttention
from genserve.shared.blocks.positions import TimestepEmbedding, timestep_embedding
from genserve.shared.blocks.rope_axes import axes_rotary, image_ids
from genserve.shared.checkpoint import load_state_strict, read_safetensors_dir, supported

CLASS_NAME = "FluxTransformer2DModel"
TIME_CHANNELS = 256


@dataclass(frozen=True)
class FluxConfig:
    in_channels: int = 64  # 16 latent channels × a 2×2 patch
    out_channels: int = 64
    n_layers: int = 19
    n_single_layers: int = 38
    n_heads: int = 24
    head_dim: int = 128
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = True
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)

    def __post_init__(self) -> None:
        if self.in_channels % 4 or self.out_channels % 4:
            raise ValueError(f"in_channels/out_channels must be 4 × the latent channels, got {self.in_channels}")
        if sum(self.axes_dims_rope) != self.head_dim:
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim ({self.head_dim})")

    @property
    def dim(self) -> int:
        return self.n_heads * self.head_dim

    @classmethod
    def from_diffusers(cls, raw: dict, where: str) -> FluxConfig:
        supported(raw, "patch_size", 1, (1,), where)
        in_channels = int(raw.get("in_channels", 64))
        return cls(in_channels=in_channels, out_channels=int(raw.get("out_channels") or in_channels),
                   n_layers=int(raw.get("num_layers", 19)), n_single_layers=int(raw.get("num_single_layers", 38)),
                   n_heads=int(raw.get("num_attention_heads", 24)), head_dim=int(raw.get("attention_head_dim", 128)),
                   joint_attention_dim=int(raw.get("joint_attention_dim", 4096)),
                   pooled_projection_dim=int(raw.get("pooled_projection_dim", 768)),
                   guidance_embeds=bool(raw.get("guidance_embeds", False)),
                   axes_dims_rope=tuple(int(d) for d in raw.get("axes_dims_rope", (16, 56, 56))))


class FluxTimeEmbed(nn.Module):
    def __init__(self, dim: int, pooled_dim: int, guidance: bool) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(TIME_CHANNELS, dim)
        if guidance:
            self.guidance_embedder = TimestepEmbedding(TIME_CHANNELS, dim)
        self.text_embedder = TimestepEmbedding(pooled_dim, dim)


class FluxDoubleBlock(nn.Module):
    """Separate weights per stream, one joint attention over [text, image] (the MMDiT block, with RoPE)."""

    def __init__(self, c: FluxConfig) -> None:
        super().__init__()
        self.norm1, self.norm1_context = AdaLayerNormZero(c.dim), AdaLayerNormZero(c.dim)
        self.attn = JointAttention(c.dim, c.n_heads, c.head_dim, qk_norm=True, context_first=True)
        self.norm2 = nn.LayerNorm(c.dim, elementwise_affine=False, eps=1e-6)
        self.ff = GeluFeedForward(c.dim)
        self.norm2_context = nn.LayerNorm(c.dim, elementwise_affine=False, eps=1e-6)
        self.ff_context = GeluFeedForward(c.dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor, y: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        nx, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, y)
        nc, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(c, y)
        x_attn, c_attn = self.attn(nx, nc, rotary)
        x = x + gate_msa[:, None] * x_attn
        x = x + gate_mlp[:, None] * self.ff(modulate(self.norm2(x), shift_mlp, scale_mlp))
        c = c + c_gate_msa[:, None] * c_attn
        c = c + c_gate_mlp[:, None] * self.ff_context(modulate(self.norm2_context(c), c_shift_mlp, c_scale_mlp))
        return x, c


class FluxSingleBlock(nn.Module):
    """One stream [text, image]: attention and a 4× GELU MLP side by side from one modulated norm, their outputs
    concatenated into one projection, gated (the parallel block of Dehghani et al. 2023, ViT-22B)."""

    def __init__(self, c: FluxConfig) -> None:
        super().__init__()
        self.norm = AdaLayerNormZeroSingle(c.dim)
        self.proj_mlp = nn.Linear(c.dim, 4 * c.dim)
        self.proj_out = nn.Linear(5 * c.dim, c.dim)
        self.attn = JointAttention(c.dim, c.n_heads, c.head_dim, qk_norm=True, has_context=False, out_proj=False)

    def forward(self, h: torch.Tensor, y: torch.Tensor, rotary) -> torch.Tensor:
        nh, gate = self.norm(h, y)
        attn, _ = self.attn(nh, None, rotary)
        mlp = F.gelu(self.proj_mlp(nh), approximate="tanh")
        return h + gate[:, None] * self.proj_out(torch.cat([attn, mlp], dim=2))


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 · w/2, 4C): each 2×2 patch's channels, (c, dy, dx) order (diffusers' _pack_latents)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of ``pack``: (B, h/2 · w/2, 4C) -> (B, C, h, w)."""
    b, _, d = tokens.shape
    x = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


class Flux(nn.Module):
    """The pipeline's denoiser, called like the U-Net: ``forward(latents (B, 16, h, w), timesteps (B,) = 1000 σ,
    context, temb=None)`` with TextConditioning (T5 tokens, the pooled CLIP vector, the guidance per row)."""

    def __init__(self, config: FluxConfig) -> None:
        super().__init__()
        self.config = c = config
        self.time_text_embed = FluxTimeEmbed(c.dim, c.pooled_projection_dim, c.guidance_embeds)
        self.context_embedder = nn.Linear(c.joint_attention_dim, c.dim)
        self.x_embedder = nn.Linear(c.in_channels, c.dim)
        self.transformer_blocks = nn.ModuleList(FluxDoubleBlock(c) for _ in range(c.n_layers))
        self.single_transformer_blocks = nn.ModuleList(FluxSingleBlock(c) for _ in range(c.n_single_layers))
        self.norm_out = AdaLayerNormContinuous(c.dim)
        self.proj_out = nn.Linear(c.dim, c.out_channels)

    def _sinusoid(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # diffusers' FluxPipeline passes t / 1000 and the model multiplies by 1000 again: the same float32 numbers
        return timestep_embedding((values.float() / 1000).to(dtype) * 1000, TIME_CHANNELS).to(dtype)

    def time_embed(self, timesteps: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(S,) timesteps (1000 σ) -> (S, D): the timestep part of y."""
        return self.time_text_embed.timestep_embedder(self._sinusoid(timesteps, dtype))

    def embed(self, latents: torch.Tensor, timesteps: torch.Tensor, context: ContextCache,
              temb: torch.Tensor | None):
        """(image tokens (B, N, D), text tokens (B, T, D), y (B, D), rotary cos/sin over [text, image])."""
        b, _, h, w = latents.shape
        tokens, pooled, guidance = gather(context)
        if temb is None:
            temb = self.time_embed(timesteps.expand(b) if timesteps.dim() == 0 else timesteps, latents.dtype)
        e = self.time_text_embed
        y = temb.expand(b, -1) + e.text_embedder(pooled.to(latents.dtype))
        if self.config.guidance_embeds:
            if guidance is None:
                raise ValueError("this Flux model embeds the guidance scale: the context must carry it")
            g = guidance.to(latents.dtype) * 1000  # FluxPipeline's scale, times 1000 as its transformer does
            y = y + e.guidance_embedder(timestep_embedding(g, TIME_CHANNELS).to(latents.dtype))
        ids = torch.cat([torch.zeros(tokens.shape[1], 3, device=latents.device),
                         image_ids(h // 2, w // 2, latents.device)])
        rotary = axes_rotary(ids, self.config.axes_dims_rope)
        return self.x_embedder(pack(latents)), self.context_embedder(tokens.to(latents.dtype)), y, rotary

    def run_blocks(self, x: torch.Tensor, c: torch.Tensor, y: torch.Tensor, rotary, start: int = 0) -> torch.Tensor:
        """The image tokens after the double blocks from ``start`` on and every single block."""
        for block in self.transformer_blocks[start:]:
            x, c = block(x, c, y, rotary)
        h = torch.cat([c, x], dim=1)
        for block in self.single_transformer_blocks:
            h = block(h, y, rotary)
        return h[:, c.shape[1]:]

    def head(self, x: torch.Tensor, y: torch.Tensor, h: int, w: int) -> torch.Tensor:
        return unpack(self.proj_out(self.norm_out(x, y)), h, w)

    def forward(self, latents: torch.Tensor, timesteps: torch.Tensor, context: ContextCache,
                temb: torch.Tensor | None = None) -> torch.Tensor:
        h, w = latents.shape[-2:]
        x, c, y, rotary = self.embed(latents, timesteps, context, temb)
        cache = getattr(context, "step_cache", None)  # FirstBlockCache (services/diffusion/step_cache.py) or None
        if cache is not None:
            return cache.run(self, x, c, y, lambda out: self.head(out, y, h, w), rotary)
        return self.head(self.run_blocks(x, c, y, rotary), y, h, w)

    def first_block(self, x, c, y, rotary):
        return self.transformer_blocks[0](x, c, y, rotary)


def load_flux(directory: str | Path, device: str | torch.device = "cpu") -> Flux:
    directory = Path(directory)
    where = str(directory / "config.json")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{where} not found")
    model = Flux(FluxConfig.from_diffusers(json.loads((directory / "config.json").read_text()), where))
    state = read_safetensors_dir(directory, ("diffusion_pytorch_model", "model"))
    load_state_strict(model, {k: v.float() for k, v in state.items()}, str(directory))
    return model.to(device).eval()
