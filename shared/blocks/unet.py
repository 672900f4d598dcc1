"""A generic conditional U-Net (section "The U-Net Architecture" and Exercise 10 of the chapter
"Deep Learning Building Blocks"): the diffusion denoiser ε_θ(x_t, t, c).

An encoder of residual blocks (Def. 9, "Residual Block") halves the resolution level by level, a decoder doubles it
back, and long skip connections concatenate every encoder activation onto the decoder input at the same resolution.
The timestep enters every residual block through a sinusoidal embedding (Def. 14, "Sinusoidal Positional Encoding")
and an MLP; text enters through cross-attention (the chapter's CrossAttn equation) in transformer blocks at chosen
levels. ``context`` may be a `ContextCache`, which a sampler passes so that each cross-attention projects the text to
keys and values once for all its steps.

The module tree follows diffusers' UNet2DConditionModel (`conv_in`, `time_embedding`, `down_blocks.N.{resnets,
attentions,downsamplers}`, `mid_block`, `up_blocks.N.{resnets,attentions,upsamplers}`, `conv_norm_out`, `conv_out`)
so a loader maps its checkpoints by name (services/diffusion/sd_unet.py). ``ff`` picks the transformer feedforward:
a GELU FFN (`ff.fc1`, `ff.fc2`; the demo model, which the fused CPU kernel runs) or diffusers' GEGLU (`ff.net.0.proj`,
`ff.net.2`). `proj_in`/`proj_out` are linear; a checkpoint's 1×1-conv form is the same map on the channel axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from genserve.shared.blocks.backend import Backend, PreparedWeights, get_backend
from genserve.shared.blocks.conv import Conv2d, Downsample, Upsample
from genserve.shared.blocks.cross_attention import ContextCache, CrossAttention
from genserve.shared.blocks.ffn import GegluFFN, GeluFFN
from genserve.shared.blocks.norms import group_norm
from genserve.shared.blocks.positions import TimestepEmbedding, timestep_embedding
from genserve.shared.blocks.residual import ResBlock

Context = torch.Tensor | ContextCache | None  # (B, M, cross_attention_dim), its cache, or None without text


@dataclass(frozen=True)
class UNetConfig:
    """Level i works at resolution H / 2^i with ``block_out_channels[i]`` channels."""

    in_channels: int = 4
    out_channels: int = 4
    block_out_channels: tuple[int, ...] = (64, 128, 128)
    layers_per_block: int = 1
    # Levels (0 = full resolution) that get a transformer block (self-attention, then cross-attention when
    # cross_attention_dim is set) after each residual block; the middle block always has one.
    attention_levels: tuple[int, ...] = (1, 2)
    cross_attention_dim: int | None = 64
    head_dim: int = 32
    # Heads per level (diffusers' num_attention_heads; the middle block uses the last): head_dim = channels / heads.
    # None: every level uses ``head_dim``.
    attention_heads: tuple[int, ...] | None = None
    norm_groups: int = 32
    resnet_eps: float = 1e-6
    out_norm_eps: float = 1e-5  # conv_norm_out's
    ff: Literal["gelu", "geglu"] = "gelu"
    # Width of the timestep embedding MLP; None means 4 × block_out_channels[0] (the DDPM/SD choice).
    time_embed_dim: int | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not self.block_out_channels:
            raise ValueError("block_out_channels must name at least one level")
        for c in self.block_out_channels:
            if c % self.norm_groups:
                raise ValueError(f"norm_groups ({self.norm_groups}) must divide every block_out_channels, got {c}")
        if self.attention_heads is not None and len(self.attention_heads) != len(self.block_out_channels):
            raise ValueError(f"attention_heads must give one count per level, got {self.attention_heads}")
        for level in self.attention_levels:
            if not 0 <= level < len(self.block_out_channels):
                raise ValueError(f"attention_levels entries must index block_out_channels, got {level}")
            self._check_heads(level, f"attention level {level}")
        self._check_heads(len(self.block_out_channels) - 1, "the middle block")
        if self.ff not in ("gelu", "geglu"):
            raise ValueError(f"ff must be 'gelu' or 'geglu', got {self.ff!r}")
        if self.layers_per_block < 1:
            raise ValueError(f"layers_per_block must be >= 1, got {self.layers_per_block}")
        if self.in_channels < 1 or self.out_channels < 1:
            raise ValueError("in_channels and out_channels must be >= 1")
        if self.cross_attention_dim is not None and self.cross_attention_dim < 1:
            raise ValueError(f"cross_attention_dim must be positive or None, got {self.cross_attention_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def _check_heads(self, level: int, where: str) -> None:
        channels = self.block_out_channels[level]
        if self.attention_heads is not None:
            if self.attention_heads[level] < 1 or channels % self.attention_heads[level]:
                raise ValueError(f"attention_heads ({self.attention_heads[level]}) must divide the channels of "
                                 f"{where} ({channels})")
        elif channels % self.head_dim:
            raise ValueError(f"head_dim ({self.head_dim}) must divide the channels of {where}")

    def level_head_dim(self, level: int) -> int:
        """Per-head width of the transformer blocks at ``level``."""
        if self.attention_heads is None:
            return self.head_dim
        return self.block_out_channels[level] // self.attention_heads[level]

    @property
    def temb_dim(self) -> int:
        return self.time_embed_dim or 4 * self.block_out_channels[0]

    @property
    def downsample_factor(self) -> int:
        """How much the lowest level shrinks H and W (sizes that do not divide round up, as in diffusers)."""
        return 2 ** (len(self.block_out_channels) - 1)


class BasicTransformerBlock(nn.Module):
    """Pre-norm block: x + SelfAttn(LN x), then x + CrossAttn(LN x, context), then x + FFN(LN x), with diffusers'
    names and layout (norm1/attn1, norm2/attn2, norm3/ff); ``ff`` is "gelu" or "geglu"."""

    def __init__(self, dim: int, n_heads: int, head_dim: int, context_dim: int | None, ff: str = "gelu") -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = CrossAttention(dim, None, n_heads, head_dim)
        self.norm2 = nn.LayerNorm(dim) if context_dim else None
        self.attn2 = CrossAttention(dim, context_dim, n_heads, head_dim) if context_dim else None
        self.norm3 = nn.LayerNorm(dim)
        self.ff = GegluFFN(dim, 4 * dim) if ff == "geglu" else GeluFFN(dim, 4 * dim)

    def forward(self, x: torch.Tensor, context: Context) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x))
        if self.attn2 is not None:
            if context is None:
                raise ValueError("context is required: this U-Net was built with cross_attention_dim")
            x = x + self.attn2(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


class SpatialTransformer(nn.Module):
    """Image tokens through one BasicTransformerBlock: GroupNorm -> proj_in -> block -> proj_out, plus the input
    (diffusers' Transformer2DModel). The backend may run the whole of a GELU-FFN one as one fused call (on the CPU:
    kernels/cpu_spatial_transformer.py), keeping what it derives from the weights in ``self.prepared``."""

    def __init__(self, channels: int, head_dim: int, context_dim: int | None, groups: int,
                 backend: Backend | None = None, ff: str = "gelu") -> None:
        super().__init__()
        self.norm = group_norm(channels, groups, eps=1e-6)
        self.proj_in = nn.Linear(channels, channels)
        self.transformer_blocks = nn.ModuleList([BasicTransformerBlock(channels, channels // head_dim, head_dim,
                                                                       context_dim, ff)])
        self.proj_out = nn.Linear(channels, channels)
        self.backend = backend or get_backend()
        self.prepared = PreparedWeights()

    @property
    def fusable(self) -> bool:
        """Whether the fused kernel's layout fits: one block with the GELU FFN."""
        return isinstance(self.transformer_blocks[0].ff, GeluFFN)

    def kernel_weights(self) -> dict:
        """The parameters and sizes under the argument names of kernels/cpu_spatial_transformer.py's BlockWeights."""
        block = self.transformer_blocks[0]
        attn1, attn2, ff = block.attn1, block.attn2, block.ff
        weights = dict(
            gn_w=self.norm.weight, gn_b=self.norm.bias, w_in=self.proj_in.weight, b_in=self.proj_in.bias,
            ln1_w=block.norm1.weight, ln1_b=block.norm1.bias, w_q=attn1.to_q.weight, w_k=attn1.to_k.weight,
            w_v=attn1.to_v.weight, b_q=attn1.to_q.bias, b_k=attn1.to_k.bias, b_v=attn1.to_v.bias,
            w_o1=attn1.to_out[0].weight, b_o1=attn1.to_out[0].bias, ln3_w=block.norm3.weight, ln3_b=block.norm3.bias,
            w_1=ff.fc1.weight, b_1=ff.fc1.bias, w_2=ff.fc2.weight, b_2=ff.fc2.bias, w_out=self.proj_out.weight,
            b_out=self.proj_out.bias, groups=self.norm.num_groups, heads=attn1.n_heads, head_dim=attn1.head_dim,
            gn_eps=self.norm.eps, ln_eps=(block.norm1.eps, block.norm2.eps if attn2 else 0.0, block.norm3.eps),
            scale=attn1.head_dim**-0.5)
        if attn2 is not None:
            weights.update(ln2_w=block.norm2.weight, ln2_b=block.norm2.bias, w_q2=attn2.to_q.weight,
                           b_q2=attn2.to_q.bias, w_o2=attn2.to_out[0].weight, b_o2=attn2.to_out[0].bias)
        return weights

    def text_keys_values(self, context: Context) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cross-attention's keys and values of ``context``, each (B, M, heads * head_dim) with the heads side by
        side, or None for a block without cross-attention."""
        attn2 = self.transformer_blocks[0].attn2
        if attn2 is None:
            return None
        if context is None:
            raise ValueError("context is required: this U-Net was built with cross_attention_dim")
        k, v = context.keys_values(attn2) if isinstance(context, ContextCache) else attn2.keys_values(context)
        return k.transpose(1, 2).flatten(2), v.transpose(1, 2).flatten(2)  # (B, H, M, D) -> (B, M, H*D)

    def forward(self, x: torch.Tensor, context: Context) -> torch.Tensor:
        fused = self.backend.spatial_transformer(x, self, context)
        if fused is not None:
            return fused
        b, c, h, w = x.shape
        tokens = self.norm(x).flatten(2).transpose(1, 2)  # (B, H*W, C)
        tokens = self.proj_in(tokens)
        for block in self.transformer_blocks:
            tokens = block(tokens, context)
        tokens = self.proj_out(tokens)
        return x + tokens.transpose(1, 2).reshape(b, c, h, w)


class DownBlock(nn.Module):
    """``layers_per_block`` residual blocks (each optionally followed by a SpatialTransformer), then a stride-2
    Downsample unless it is the last level. Returns the output and every intermediate for the skip stack."""

    def __init__(self, in_ch: int, out_ch: int, config: UNetConfig, level: int, attention: bool, downsample: bool
                 ) -> None:
        super().__init__()
        n, g = config.layers_per_block, config.norm_groups
        self.resnets = nn.ModuleList(
            ResBlock(in_ch if i == 0 else out_ch, out_ch, config.temb_dim, g, config.dropout, config.resnet_eps)
            for i in range(n)
        )
        self.attentions = nn.ModuleList(
            SpatialTransformer(out_ch, config.level_head_dim(level), config.cross_attention_dim, g, ff=config.ff)
            for _ in range(n)
        ) if attention else None
        self.downsamplers = nn.ModuleList([Downsample(out_ch)]) if downsample else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: Context
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        skips = []
        for i, resnet in enumerate(self.resnets):
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[i](x, context)
            skips.append(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)  # (B, C, H/2, W/2)
            skips.append(x)
        return x, skips


class MidBlock(nn.Module):
    """ResBlock -> SpatialTransformer -> ResBlock at the lowest resolution."""

    def __init__(self, channels: int, config: UNetConfig) -> None:
        super().__init__()
        g, level = config.norm_groups, len(config.block_out_channels) - 1
        self.resnets = nn.ModuleList(ResBlock(channels, channels, config.temb_dim, g, config.dropout, config.resnet_eps)
                                     for _ in range(2))
        self.attentions = nn.ModuleList([SpatialTransformer(channels, config.level_head_dim(level),
                                                            config.cross_attention_dim, g, ff=config.ff)])

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: Context) -> torch.Tensor:
        x = self.resnets[0](x, temb)
        x = self.attentions[0](x, context)
        return self.resnets[1](x, temb)


class UpBlock(nn.Module):
    """``layers_per_block + 1`` residual blocks, each eating one skip by concatenation (the long skip
    connections), optionally followed by a SpatialTransformer; then nearest-Upsample unless it is the top level."""

    def __init__(self, in_ch: int, skip_chs: list[int], out_ch: int, config: UNetConfig, level: int,
                 attention: bool, upsample: bool) -> None:
        super().__init__()
        g, eps = config.norm_groups, config.resnet_eps
        self.resnets = nn.ModuleList(
            ResBlock((in_ch if i == 0 else out_ch) + skip, out_ch, config.temb_dim, g, config.dropout, eps)
            for i, skip in enumerate(skip_chs)
        )
        self.attentions = nn.ModuleList(
            SpatialTransformer(out_ch, config.level_head_dim(level), config.cross_attention_dim, g, ff=config.ff)
            for _ in skip_chs
        ) if attention else None
        self.upsamplers = nn.ModuleList([Upsample(out_ch)]) if upsample else None

    def forward(self, x: torch.Tensor, skips: list[torch.Tensor], temb: torch.Tensor,
                context: Context) -> torch.Tensor:
        for i, resnet in enumerate(self.resnets):
            x = resnet(torch.cat([x, skips.pop()], dim=1), temb)  # (B, C + C_skip, H, W)
            if self.attentions is not None:
                x = self.attentions[i](x, context)
        if self.upsamplers is not None:
            # (B, C, 2H, 2W), or the next skip's size where the encoder rounded an odd size up
            x = self.upsamplers[0](x, size=tuple(skips[-1].shape[-2:]))
        return x


class UNet(nn.Module):
    """ε_θ(x_t, t, context): (B, in_channels, H, W), (B,) timesteps, (B, M, cross_attention_dim) -> (B, out, H, W)."""

    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        self.config = config
        chs, n_levels = config.block_out_channels, len(config.block_out_channels)
        self.conv_in = Conv2d(config.in_channels, chs[0], 3, padding=1)
        self.time_embedding = TimestepEmbedding(chs[0], config.temb_dim)

        skip_stack = [chs[0]]  # channels of every tensor the encoder hands to the decoder, in push order
        self.down_blocks = nn.ModuleList()
        for level, out_ch in enumerate(chs):
            in_ch = chs[max(level - 1, 0)]
            last = level == n_levels - 1
            self.down_blocks.append(DownBlock(in_ch, out_ch, config, level, level in config.attention_levels,
                                              not last))
            skip_stack += [out_ch] * config.layers_per_block + ([] if last else [out_ch])

        self.mid_block = MidBlock(chs[-1], config)

        self.up_blocks = nn.ModuleList()
        prev = chs[-1]
        for level in reversed(range(n_levels)):
            skips = [skip_stack.pop() for _ in range(config.layers_per_block + 1)]
            attention = level in config.attention_levels
            self.up_blocks.append(UpBlock(prev, skips, chs[level], config, level, attention, upsample=level > 0))
            prev = chs[level]

        self.conv_norm_out = group_norm(chs[0], config.norm_groups, eps=config.out_norm_eps)
        self.conv_out = Conv2d(chs[0], config.out_channels, 3, padding=1)

    def time_embed(self, timesteps: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(B,) timesteps -> (B, temb_dim): the sinusoidal features through the time MLP. A sampler knows all its
        timesteps up front and may embed them in one call, then pass each row to ``forward`` as ``temb``."""
        return self.time_embedding(timestep_embedding(timesteps, self.config.block_out_channels[0]).to(dtype))

    def forward(self, sample: torch.Tensor, timesteps: torch.Tensor, context: Context = None, *,
                temb: torch.Tensor | None = None) -> torch.Tensor:
        """``temb`` (B, temb_dim), when given, is ``time_embed(timesteps)`` computed beforehand; (1, temb_dim)
        serves a batch that shares one timestep (it broadcasts where each ResBlock adds it)."""
        b = sample.shape[0]
        if temb is None:
            temb = self.time_embed(timesteps.expand(b) if timesteps.dim() == 0 else timesteps, sample.dtype)

        x = self.conv_in(sample)
        skips = [x]
        for block in self.down_blocks:
            x, block_skips = block(x, temb, context)
            skips += block_skips
        x = self.mid_block(x, temb, context)
        for block in self.up_blocks:
            x = block(x, skips, temb, context)
        return self.conv_out(self.conv_norm_out(x, silu=True))
