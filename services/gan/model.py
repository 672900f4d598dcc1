"""A DCGAN (Radford et al. 2016) for 32×32 shapes, with a spectrally normalised discriminator (Miyato et al. 2018).

The table "Architectures for Generative Models" of the chapter "Deep Learning Building Blocks": the generator is an
upsampling CNN (here nearest-upsample + conv from the shared blocks, which avoids checkerboard artifacts: Remark 4,
"Checkerboard Artifacts") with BatchNorm, ReLU and a Tanh output; the discriminator is a downsampling CNN of strided
convolutions with LeakyReLU and spectral normalisation.

Two additions against mode collapse and muddled colours:
- the discriminator's last feature map gets a minibatch-standard-deviation channel (Karras et al. 2018, §3), so a
  generator that draws the same picture for every z is easy to tell apart from data;
- with ``n_classes`` > 0 the GAN is class-conditional on shape×colour (24 classes) or on all four attributes (240),
  but the class is *read off the latent*:
  c(z) = argmax(z[:n_classes]). The generator therefore stays a function of z alone (seeded sampling, truncation and
  slerp work unchanged), and since the argmax of i.i.d. symmetric coordinates is uniform, every class is equally
  likely at any truncation. The generator adds a learned class embedding to its projected latent; the discriminator
  is a projection discriminator (Miyato & Koyama 2018): D(x, c) = ψ(φ(x)) + <e_c, φ(x)>, real images labelled by
  their dataset attributes.

Latent space (``space="latent"``, the demo model): the generator network draws a scaled 4×8×8 VAE latent and a frozen
copy of the trained VAE decoder renders it; the discriminator judges latents (real ones: VAE encodings of dataset
images). The adversarial game is then played in a 256-dimensional space whose decoder already draws crisp shapes,
which on 2 shared CPU cores trains far faster than a pixel-space GAN (measured in docs/models.md).

Generator: z (B, z_dim) -> (B, 3, 32, 32) in [-1, 1]. Discriminator: the generated features (images, or latents)
-> logits (B,).
Training objective (hinge loss, Lim & Ye 2017):
    L_D = E[max(0, 1 - D(x))] + E[max(0, 1 + D(G(z)))],    L_G = -E[D(G(z))].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

from genserve.services.common.weights import committed_weights
from genserve.services.shapes.dataset import COLOURS, POSITIONS, SHAPES, SIZES
from genserve.shared.blocks.activations import activation
from genserve.shared.blocks.autoencoder import VAE, VAEConfig
from genserve.shared.blocks.conv import Upsample, conv2d_same
from genserve.shared.blocks.linear import RowwiseLinear
from genserve.shared.blocks.norms import norm
from genserve.shared.checkpoint import load_weights, read_config

DEFAULT_WEIGHTS = committed_weights("gan")


@dataclass(frozen=True)
class GANConfig:
    """Generator and discriminator widths; each tuple has one entry per resolution from 4×4 up to the image."""

    z_dim: int = 64
    image_size: int = 32
    out_channels: int = 3
    g_channels: tuple[int, ...] = (96, 64, 32, 16)  # at 4, 8, 16, 32 pixels
    d_channels: tuple[int, ...] = (32, 64, 128)  # after each stride-2 conv: 16, 8, 4 pixels
    leaky_slope: float = 0.2
    minibatch_std: bool = True
    n_classes: int = 0  # 0: unconditional; else class c(z) = argmax(z[:n_classes]) (module docstring)
    # "pixel": the generator draws images. "latent": it draws (scaled) VAE latents and a frozen copy of the VAE
    # decoder, described by the vae_* fields, renders them (module docstring).
    space: str = "pixel"
    vae_block_out_channels: tuple[int, ...] = (16, 32, 64)
    vae_layers_per_block: int = 1
    vae_norm_groups: int = 8
    vae_latent_channels: int = 4
    vae_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.z_dim < 1:
            raise ValueError(f"z_dim must be >= 1, got {self.z_dim}")
        if self.space not in ("pixel", "latent"):
            raise ValueError(f"space must be 'pixel' or 'latent', got {self.space!r}")
        if 4 * 2 ** (len(self.g_channels) - 1) != self.g_side:
            raise ValueError(f"g_channels needs one entry per doubling from 4 to the generated side ({self.g_side})")
        if self.g_side // 2 ** len(self.d_channels) != 4:
            raise ValueError(f"d_channels needs one entry per halving from the generated side ({self.g_side}) to 4")
        if not 0 <= self.leaky_slope < 1:
            raise ValueError(f"leaky_slope must be in [0, 1), got {self.leaky_slope}")
        if not 0 <= self.n_classes <= self.z_dim:
            raise ValueError(f"n_classes must be in [0, z_dim={self.z_dim}], got {self.n_classes}")

    def vae_config(self) -> VAEConfig:
        """The autoencoder whose decoder renders a latent-space generator's output."""
        return VAEConfig(
            in_channels=self.out_channels,
            image_size=self.image_size,
            latent_channels=self.vae_latent_channels,
            block_out_channels=self.vae_block_out_channels,
            layers_per_block=self.vae_layers_per_block,
            norm_groups=self.vae_norm_groups,
            scaling_factor=self.vae_scaling_factor,
        )

    @property
    def g_side(self) -> int:
        """Side of what the generator network draws: the image, or the VAE latent."""
        if self.space == "pixel":
            return self.image_size
        return self.image_size // 2 ** (len(self.vae_block_out_channels) - 1)

    @property
    def g_out_channels(self) -> int:
        return self.out_channels if self.space == "pixel" else self.vae_latent_channels


def latent_classes(z: torch.Tensor, n_classes: int) -> torch.Tensor:
    """The class a latent encodes: argmax over its first ``n_classes`` coordinates, (B,) int64."""
    return z[:, :n_classes].argmax(dim=1)


SHAPE_COLOUR_CLASSES = len(SHAPES) * len(COLOURS)
ALL_ATTRIBUTE_CLASSES = SHAPE_COLOUR_CLASSES * len(SIZES) * len(POSITIONS)


def class_of(attrs: dict[str, str], n_classes: int = SHAPE_COLOUR_CLASSES) -> int:
    """Dataset attributes -> class index, the labels of the conditional GAN: shape×colour (24 classes, shape-major)
    or, with ``n_classes`` = 240, shape×colour×size×position (the same index, then size, then position)."""
    index = SHAPES.index(attrs["shape"]) * len(COLOURS) + list(COLOURS).index(attrs["colour"])
    if n_classes == SHAPE_COLOUR_CLASSES:
        return index
    if n_classes == ALL_ATTRIBUTE_CLASSES:
        index = index * len(SIZES) + SIZES.index(attrs["size"])
        return index * len(POSITIONS) + list(POSITIONS).index(attrs["position"])
    raise ValueError(f"n_classes must be {SHAPE_COLOUR_CLASSES} or {ALL_ATTRIBUTE_CLASSES}, got {n_classes}")


class GeneratorBlock(nn.Module):
    """Double the resolution: nearest-upsample + 3×3 conv, BatchNorm, ReLU."""

    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.upsample = Upsample(in_ch, out_ch)
        self.norm = norm("batchnorm2d", out_ch)
        self.act = activation("relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.upsample(x)))  # (B, out_ch, 2H, 2W)


class Generator(nn.Module):
    """z (B, z_dim) -> image (B, 3, 32, 32) in [-1, 1]."""

    def __init__(self, config: GANConfig) -> None:
        super().__init__()
        self.config = config
        first = config.g_channels[0]
        self.project = RowwiseLinear(config.z_dim, first * 4 * 4)  # batch-invariant: served images are batched
        self.class_embed = nn.Embedding(config.n_classes, first * 4 * 4) if config.n_classes else None
        self.project_norm = norm("batchnorm2d", first)
        self.blocks = nn.ModuleList(
            [GeneratorBlock(a, b) for a, b in zip(config.g_channels, config.g_channels[1:], strict=False)]
        )
        if config.space == "pixel":
            self.to_rgb = conv2d_same(config.g_channels[-1], config.out_channels, 3)
            self.out_act = activation("tanh")
        else:
            self.to_latent = conv2d_same(config.g_channels[-1], config.vae_latent_channels, 3)
            vae = VAE(config.vae_config())  # only its decoder half is kept, frozen
            self.post_quant_conv, self.decoder = vae.post_quant_conv, vae.decoder
            self.post_quant_conv.requires_grad_(False)
            self.decoder.requires_grad_(False)

    def features(self, z: torch.Tensor) -> torch.Tensor:
        """What the generator network draws: images (pixel space) or scaled VAE latents (latent space)."""
        h = self.project(z)  # (B, C0·16)
        if self.class_embed is not None:
            h = h + self.class_embed(latent_classes(z, self.config.n_classes))
        h = h.view(z.shape[0], -1, 4, 4)  # (B, C0, 4, 4)
        h = torch.relu(self.project_norm(h))
        for block in self.blocks:
            h = block(h)  # ... -> (B, C_last, side, side)
        if self.config.space == "pixel":
            return self.out_act(self.to_rgb(h))  # (B, 3, 32, 32) in [-1, 1]
        return self.to_latent(h)  # (B, 4, 8, 8), scaled like the diffusion model's latents

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """z (B, z_dim) -> images (B, 3, 32, 32) in [-1, 1]."""
        out = self.features(z)
        if self.config.space == "pixel":
            return out
        latents = out / self.config.vae_scaling_factor
        return self.decoder(self.post_quant_conv(latents)).clamp(-1, 1)  # (B, 3, 32, 32)


def minibatch_std(x: torch.Tensor) -> torch.Tensor:
    """Append one channel holding the mean over features of the per-feature std across the batch (ProGAN §3)."""
    std = x.std(dim=0, unbiased=False).mean()  # scalar: how varied the batch is
    return torch.cat([x, std.expand(x.shape[0], 1, *x.shape[2:])], dim=1)  # (B, C+1, H, W)


class Discriminator(nn.Module):
    """x (B, 3, 32, 32) -> realness logits (B,); every weight layer spectrally normalised."""

    def __init__(self, config: GANConfig) -> None:
        super().__init__()
        self.config = config
        self.conv_in = spectral_norm(conv2d_same(config.g_out_channels, config.d_channels[0], 3))
        widths = (config.d_channels[0], *config.d_channels)
        self.blocks = nn.ModuleList(
            [spectral_norm(conv2d_same(a, b, 3, stride=2)) for a, b in zip(widths, widths[1:], strict=False)]
        )
        self.act = activation("leaky_relu", negative_slope=config.leaky_slope)
        head_in = (config.d_channels[-1] + int(config.minibatch_std)) * 4 * 4
        self.head = spectral_norm(nn.Linear(head_in, 1))
        self.class_embed = spectral_norm(nn.Embedding(config.n_classes, head_in)) if config.n_classes else None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """``labels`` (B,) class indices, required exactly when the config is conditional."""
        if (labels is None) != (self.class_embed is None):
            raise ValueError(f"labels must be given iff n_classes > 0 (n_classes={self.config.n_classes})")
        h = self.act(self.conv_in(x))  # (B, D0, side, side)
        for conv in self.blocks:
            h = self.act(conv(h))  # halves H, W: ... -> (B, C_last, 4, 4)
        if self.config.minibatch_std:
            h = minibatch_std(h)
        features = h.flatten(1)  # (B, (C_last + 1)·16)
        logits = self.head(features).squeeze(1)  # (B,)
        if self.class_embed is not None:
            logits = logits + (self.class_embed(labels) * features).sum(dim=1)  # projection term <e_c, φ(x)>
        return logits


def load_generator(path: str | Path | None = None, device: str | torch.device = "cpu") -> Generator:
    """Load a generator from a checkpoint directory (config.json + model.safetensors); None -> services/gan/weights/."""
    directory = Path(path) if path is not None else DEFAULT_WEIGHTS
    generator = Generator(read_config(directory, GANConfig))
    load_weights(directory, generator, device=device)
    return generator.to(device).eval()
