"""A small KL-regularised variational autoencoder for 32×32 images (Kingma & Welling 2014; the latent-diffusion
autoencoder of Rombach et al. 2022), with a 4×8×8 latent.

The table "Architectures for Generative Models" of the chapter "Deep Learning Building Blocks" lists the VAE as a
downsampling CNN encoder and an upsampling CNN decoder; here both are built from the shared blocks: ResBlocks (Def. 9,
"Residual Block"; GroupNorm + SiLU), strided-conv downsampling and nearest-upsample + conv upsampling (no checkerboard
artifacts: Remark 4, "Checkerboard Artifacts").

The module tree follows diffusers' ``AutoencoderKL`` (``encoder.conv_in``, ``encoder.down_blocks.N.resnets.M``,
``encoder.down_blocks.N.downsamplers.0.conv``, ``encoder.mid_block.resnets.M``, ``encoder.conv_norm_out``,
``encoder.conv_out``, ``quant_conv``, ``post_quant_conv``, ``decoder.*`` with ``up_blocks.N.upsamplers.0.conv``) so
a loader maps its checkpoints onto ours by name (shared/blocks/autoencoder_kl.py). ``mid_attention`` adds the
mid-block self-attention of the Stable Diffusion autoencoder; the demo model has none (at 8×8 the convolutions
already see the whole latent).

Objective (the negative ELBO with a weighted KL, per element):
    L = mean (x - D(z))² + β · mean KL(N(μ, σ²) ‖ N(0, 1)),  z = μ + σ·ε,
    KL = ½ (μ² + σ² - 1 - log σ²).
Images are (B, 3, 32, 32) in [-1, 1]; the decoder output is not clamped (clamp when converting to pixels).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from genserve.shared.blocks.conv import Conv2d, Downsample, Upsample
from genserve.shared.blocks.norms import group_norm
from genserve.shared.blocks.residual import ResBlock
from genserve.shared.blocks.spatial_attention import SpatialSelfAttention
from genserve.shared.checkpoint import load_weights, read_config


@dataclass(frozen=True)
class VAEConfig:
    """Autoencoder architecture; ``scaling_factor`` is 1 / std of the latents, measured on data after training."""

    in_channels: int = 3
    image_size: int = 32
    latent_channels: int = 4
    block_out_channels: tuple[int, ...] = (16, 32, 64)  # one block per resolution; all but the last downsample
    layers_per_block: int = 1
    norm_groups: int = 8
    kl_weight: float = 1e-5
    scaling_factor: float = 1.0
    # The SD autoencoder's self-attention between the two mid-block ResBlocks (diffusers' mid_block_add_attention).
    mid_attention: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.in_channels < 1:
            raise ValueError(f"in_channels must be >= 1, got {self.in_channels}")
        if self.latent_channels < 1:
            raise ValueError(f"latent_channels must be >= 1, got {self.latent_channels}")
        if not self.block_out_channels:
            raise ValueError("block_out_channels must name at least one block")
        if any(c % self.norm_groups for c in self.block_out_channels):
            raise ValueError(f"norm_groups ({self.norm_groups}) must divide every block_out_channels entry")
        if self.image_size % self.downsample_factor:
            raise ValueError(f"image_size ({self.image_size}) must be divisible by {self.downsample_factor}")
        if self.layers_per_block < 1:
            raise ValueError(f"layers_per_block must be >= 1, got {self.layers_per_block}")
        if self.kl_weight < 0:
            raise ValueError(f"kl_weight must be >= 0, got {self.kl_weight}")
        if self.scaling_factor <= 0:
            raise ValueError(f"scaling_factor must be > 0, got {self.scaling_factor}")

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        side = self.image_size // self.downsample_factor
        return (self.latent_channels, side, side)


class DownBlock(nn.Module):
    """ResBlocks at one resolution, then (optionally) a stride-2 downsample; diffusers' DownEncoderBlock2D."""

    def __init__(self, in_ch: int, out_ch: int, layers: int, groups: int, downsample: bool, eps: float = 1e-6
                 ) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResBlock(in_ch if i == 0 else out_ch, out_ch, groups=groups, eps=eps) for i in range(layers)]
        )
        # padding=0 + asymmetric pad: the SD/diffusers VAE encoder convention, so weights map one to one.
        self.downsamplers = nn.ModuleList([Downsample(out_ch, padding=0)]) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)  # (B, C, H/2, W/2)
        return x


class UpBlock(nn.Module):
    """ResBlocks at one resolution, then (optionally) nearest-upsample + conv; diffusers' UpDecoderBlock2D."""

    def __init__(self, in_ch: int, out_ch: int, layers: int, groups: int, upsample: bool, eps: float = 1e-6
                 ) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResBlock(in_ch if i == 0 else out_ch, out_ch, groups=groups, eps=eps) for i in range(layers)]
        )
        self.upsamplers = nn.ModuleList([Upsample(out_ch)]) if upsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)  # (B, C, 2H, 2W)
        return x


class MidBlock(nn.Module):
    """Two ResBlocks at the lowest resolution, with a SpatialSelfAttention between them when ``attention``
    (diffusers' UNetMidBlock2D)."""

    def __init__(self, channels: int, groups: int, attention: bool = False, eps: float = 1e-6) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResBlock(channels, groups=groups, eps=eps) for _ in range(2)])
        self.attentions = nn.ModuleList([SpatialSelfAttention(channels, groups, eps=eps)]) if attention else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class Encoder(nn.Module):
    """x (B, 3, 32, 32) -> (B, 2·latent_channels, 8, 8): mean and log-variance stacked on channels."""

    def __init__(self, config: VAEConfig) -> None:
        super().__init__()
        chans = config.block_out_channels
        self.conv_in = Conv2d(config.in_channels, chans[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            [
                DownBlock(chans[max(i - 1, 0)], c, config.layers_per_block, config.norm_groups, i < len(chans) - 1,
                          config.norm_eps)
                for i, c in enumerate(chans)
            ]
        )
        self.mid_block = MidBlock(chans[-1], config.norm_groups, config.mid_attention, config.norm_eps)
        self.conv_norm_out = group_norm(chans[-1], config.norm_groups, config.norm_eps)
        self.conv_out = Conv2d(chans[-1], 2 * config.latent_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)  # (B, C0, 32, 32)
        for block in self.down_blocks:
            h = block(h)
        h = self.mid_block(h)  # (B, C_last, 8, 8)
        return self.conv_out(self.conv_norm_out(h, silu=True))  # (B, 2L, 8, 8)


class Decoder(nn.Module):
    """z (B, latent_channels, 8, 8) -> (B, 3, 32, 32); one more ResBlock per level than the encoder, as in diffusers."""

    def __init__(self, config: VAEConfig) -> None:
        super().__init__()
        chans = tuple(reversed(config.block_out_channels))
        self.conv_in = Conv2d(config.latent_channels, chans[0], 3, padding=1)
        self.mid_block = MidBlock(chans[0], config.norm_groups, config.mid_attention, config.norm_eps)
        self.up_blocks = nn.ModuleList(
            [
                UpBlock(chans[max(i - 1, 0)], c, config.layers_per_block + 1, config.norm_groups, i < len(chans) - 1,
                        config.norm_eps)
                for i, c in enumerate(chans)
            ]
        )
        self.conv_norm_out = group_norm(chans[-1], config.norm_groups, config.norm_eps)
        self.conv_out = Conv2d(chans[-1], config.in_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid_block(self.conv_in(z))  # (B, C_last, 8, 8)
        for block in self.up_blocks:
            h = block(h)
        return self.conv_out(self.conv_norm_out(h, silu=True))  # (B, 3, 32, 32)


class VAE(nn.Module):
    """The autoencoder: ``encode`` -> (mean, logvar), ``decode``, ``reconstruct``, ``sample`` from the prior."""

    def __init__(self, config: VAEConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.quant_conv = Conv2d(2 * config.latent_channels, 2 * config.latent_channels, 1)
        self.post_quant_conv = Conv2d(config.latent_channels, config.latent_channels, 1)
        self.decoder = Decoder(config)

    @property
    def scaling_factor(self) -> float:
        """Multiply latents by this before diffusion (unit variance), divide before ``decode``."""
        return self.config.scaling_factor

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, 3, 32, 32) in [-1, 1] -> (mean, logvar), each (B, latent_channels, 8, 8)."""
        mean, logvar = self.quant_conv(self.encoder(x)).chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)  # diffusers' clamp keeps exp(logvar) finite

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """z (B, latent_channels, 8, 8) -> images (B, 3, 32, 32), nominally in [-1, 1]."""
        return self.decoder(self.post_quant_conv(z))

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        """Deterministic round trip through the posterior mean: decode(mean(encode(x)))."""
        return self.decode(self.encode(x)[0])

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Decode ``n`` draws z ~ N(0, I) from the prior: (n, 3, 32, 32)."""
        device = next(self.parameters()).device
        z = torch.randn((n, *self.config.latent_shape), generator=generator, device=device)
        return self.decode(z)

    def loss(self, x: torch.Tensor, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """The module-docstring objective on a batch, with the reparameterised sample z = μ + σ·ε."""
        mean, logvar = self.encode(x)
        eps = torch.randn(mean.shape, generator=generator, device=mean.device)
        z = mean + torch.exp(0.5 * logvar) * eps
        recon = F.mse_loss(self.decode(z), x)
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
        return {"loss": recon + self.config.kl_weight * kl, "mse": recon, "kl": kl}


def load_autoencoder(directory: str | Path, device: str | torch.device = "cpu") -> VAE:
    """Load a VAE from a checkpoint directory (config.json + model.safetensors), in eval mode."""
    vae = VAE(read_config(Path(directory), VAEConfig))
    load_weights(directory, vae, device=device)
    return vae.to(device).eval()
