"""VAE quality on held-out shapes: PSNR of reconstructions, and whether the reader still reads them right."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from genserve.services.shapes.dataset import sample_batch
from genserve.services.shapes.reader import accuracy, read_batch
from genserve.shared.blocks.autoencoder import VAE


def psnr(reference: torch.Tensor, estimate: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of images in [-1, 1], estimate clamped to [-1, 1]:
    10 log10(2² / MSE) with the MSE over the whole set (peak-to-peak 2, so equal to PSNR on 0..255 pixels)."""
    mse = F.mse_loss(estimate.clamp(-1, 1), reference).item()
    return float("inf") if mse == 0 else 10.0 * torch.log10(torch.tensor(4.0 / mse)).item()


@torch.no_grad()
def reconstruct_in_batches(vae: VAE, images: torch.Tensor, batch_size: int = 250) -> torch.Tensor:
    device = next(vae.parameters()).device
    return torch.cat([vae.reconstruct(chunk.to(device)).cpu() for chunk in images.split(batch_size)])


def evaluate(vae: VAE, n_images: int = 1000, seed: int = 0, read: bool = True) -> dict[str, float]:
    """PSNR (dB) over ``n_images`` held-out images; with ``read``, the reader's accuracy on the reconstructions."""
    images, _, attrs = sample_batch(n_images, seed=seed, split="heldout")
    recon = reconstruct_in_batches(vae.eval(), images)
    metrics = {"psnr_db": psnr(images, recon)}
    if read:
        metrics.update({f"recon_read_{k}": v for k, v in accuracy(read_batch(recon), attrs).items()})
    return metrics
