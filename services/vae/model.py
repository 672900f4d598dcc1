"""The vae service's model: the autoencoder of shared/blocks/autoencoder.py with the committed demo weights."""

from __future__ import annotations

from pathlib import Path

import torch

from genserve.services.common.weights import committed_weights
from genserve.shared.blocks.autoencoder import VAE, load_autoencoder

DEFAULT_WEIGHTS = committed_weights("vae")


def load_vae(path: str | Path | None = None, device: str | torch.device = "cpu") -> VAE:
    """Load a VAE from a checkpoint directory; None -> the committed one (services/vae/weights/)."""
    return load_autoencoder(path if path is not None else DEFAULT_WEIGHTS, device)
