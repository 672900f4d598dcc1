"""Random tiny Flux-format pipelines, built with diffusers' and transformers' own classes and saved with
``save_pretrained``: the reference side of the Flux parity tests and of ``bench/diffusion.py``.

Flux-shaped: a FluxTransformer2DModel (double- and single-stream blocks, 3-axis RoPE, the guidance embedding), a
16-channel AutoencoderKL without quant convs and with Flux's scaling and shift factors, a CLIPTextModel (its pooled
output) and a T5EncoderModel, and FlowMatchEulerDiscreteScheduler with dynamic shifting, as FLUX.1-dev ships.

    python -m tests.services.diffusion.tiny_flux OUT_DIR [--latent 64] [--layers 1] [--single-layers 2]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from tests.services.diffusion.tiny_sd import write_clip_vocab
from tests.services.diffusion.tiny_sd3 import t5_tokenizer

FLUX_SCALING, FLUX_SHIFT = 0.3611, 0.1159  # FLUX.1's vae/config.json


def build_tiny_flux(directory: Path, *, latent: int = 16, layers: int = 1, single_layers: int = 2, heads: int = 2,
                    head_dim: int = 16, guidance_embeds: bool = True, seed: int = 0) -> Path:
    """Save a random FluxPipeline into ``directory`` (native size ``8 * latent`` pixels)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel

    directory = Path(directory)
    vocab = write_clip_vocab(directory.parent / f"{directory.name}-vocab")
    tokenizer, tokenizer_2 = CLIPTokenizer.from_pretrained(vocab), t5_tokenizer()
    torch.manual_seed(seed)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    t5 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=48, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                 relative_attention_num_buckets=8, relative_attention_max_distance=32,
                                 feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0,
                                 eos_token_id=1))
    rope = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=layers, num_single_layers=single_layers, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=48, pooled_projection_dim=32, guidance_embeds=guidance_embeds,
        axes_dims_rope=rope)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16), layers_per_block=1,
        latent_channels=16, norm_num_groups=8, sample_size=8 * latent, scaling_factor=FLUX_SCALING,
        shift_factor=FLUX_SHIFT, use_quant_conv=False, use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=tokenizer, text_encoder_2=t5,
                        tokenizer_2=tokenizer_2, transformer=transformer)
    pipe.save_pretrained(directory)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(vocab / name, directory / "tokenizer" / name)
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--latent", type=int, default=64, help="native latent side (images are 8x larger)")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--single-layers", type=int, default=2)
    args = parser.parse_args(argv)
    build_tiny_flux(args.out, latent=args.latent, layers=args.layers, single_layers=args.single_layers)
    print(args.out)


if __name__ == "__main__":
    main()
