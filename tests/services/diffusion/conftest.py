"""A tiny randomly initialised latent-diffusion model shared by the pipeline tests."""

from __future__ import annotations

import pytest
import torch

from genserve.services.diffusion.model import DiffusionConfig, LatentDiffusion
from genserve.services.diffusion.pipeline import DiffusionPipeline
from genserve.services.diffusion.schedulers import NoiseScheduleConfig
from genserve.services.diffusion.text_encoder import TextEncoderConfig
from genserve.services.diffusion.tokenizer import caption_vocabulary
from genserve.shared.blocks.unet import UNetConfig


def tiny_config(prediction_type: str = "v_prediction") -> DiffusionConfig:
    vocabulary = caption_vocabulary()
    return DiffusionConfig(
        unet=UNetConfig(block_out_channels=(16, 32), attention_levels=(1,), cross_attention_dim=16, head_dim=8,
                        norm_groups=8),
        text=TextEncoderConfig(vocab_size=len(vocabulary), max_length=12, dim=16, n_layers=1, n_heads=2),
        schedule=NoiseScheduleConfig(beta_schedule="squaredcos_cap_v2", prediction_type=prediction_type,
                                     timestep_spacing="trailing"),
        vocabulary=vocabulary,
        scaling_factor=0.5,
    )


@pytest.fixture
def tiny_model() -> LatentDiffusion:
    torch.manual_seed(0)
    return LatentDiffusion(tiny_config()).eval()


@pytest.fixture
def tiny_pipe(tiny_model: LatentDiffusion) -> DiffusionPipeline:
    return DiffusionPipeline(tiny_model)
