"""Latent text-to-image diffusion: U-Net wrapper, text encoder, schedulers, pipeline and training."""
