"""Random tiny SD3-format pipelines, built with diffusers' and transformers' own classes and saved with
``save_pretrained``: the reference side of the SD3 parity tests and of ``bench/diffusion.py --sd3``.

SD3-shaped (Esser et al. 2024): an SD3Transformer2DModel (MMDiT, 2×2 patches, joint attention with RMS QK-norm), a
16-channel AutoencoderKL without quant convs and with SD3's scaling and shift factors, two CLIPTextModelWithProjection
encoders (CLIP-L and CLIP-G; the second pads with "!"), a T5EncoderModel (gated-GELU, T5 v1.1 as in SD3) with a
SentencePiece-style unigram vocabulary made here, and FlowMatchEulerDiscreteScheduler with shift 3.0.

    python -m tests.services.diffusion.tiny_sd3 OUT_DIR [--latent 64] [--layers 2] [--width 32]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from tests.services.diffusion.tiny_sd import CAPTIONS, write_clip_vocab

# SD3-medium's VAE factors (its vae/config.json).
SD3_SCALING, SD3_SHIFT = 1.5305, 0.0609


def t5_vocab() -> list[tuple[str, float]]:
    """A unigram vocabulary in T5's order (<pad>, </s>, <unk>, then pieces with log-probabilities): every word of the
    captions as "▁word", every character alone, so any caption tokenizes."""
    words = sorted({w.lower() for caption in CAPTIONS for w in caption.split()})
    chars = {c for caption in CAPTIONS for c in caption.lower() if not c.isspace()}
    chars = sorted(chars | set("abcdefghijklmnopqrstuvwxyz0123456789"))
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(f"▁{w}", -3.0 - 0.01 * i) for i, w in enumerate(words)]
    pieces += [(c, -8.0 - 0.01 * i) for i, c in enumerate(chars)]
    return pieces


def t5_tokenizer():
    from transformers import T5TokenizerFast

    return T5TokenizerFast(vocab=t5_vocab(), extra_ids=0)


def build_tiny_sd3(directory: Path, *, latent: int = 16, layers: int = 2, width: int = 32, heads: int = 4,
                   qk_norm: str | None = "rms_norm", shift: float = 3.0, seed: int = 0) -> Path:
    """Save a random StableDiffusion3Pipeline into ``directory`` (native size ``8 * latent`` pixels; the transformer is
    ``layers`` joint blocks of ``width`` channels)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5Config, T5EncoderModel

    directory = Path(directory)
    vocab_l = write_clip_vocab(directory.parent / f"{directory.name}-vocab-l")
    vocab_g = write_clip_vocab(directory.parent / f"{directory.name}-vocab-g", pad_token="!")
    tokenizer, tokenizer_2 = CLIPTokenizer.from_pretrained(vocab_l), CLIPTokenizer.from_pretrained(vocab_g)
    tokenizer_3 = t5_tokenizer()
    torch.manual_seed(seed)

    def clip(tok, hidden: int, projection: int) -> CLIPTextModelWithProjection:
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=77, hidden_act="gelu", projection_dim=projection,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))

    text_encoder, text_encoder_2 = clip(tokenizer, 32, 32), clip(tokenizer_2, 48, 32)
    t5 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_3), d_model=80, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                 relative_attention_num_buckets=8, relative_attention_max_distance=32,
                                 feed_forward_proj="gated-gelu", decoder_start_token_id=0, pad_token_id=0,
                                 eos_token_id=1))
    transformer = SD3Transformer2DModel(
        sample_size=latent, patch_size=2, in_channels=16, num_layers=layers, attention_head_dim=width // heads,
        num_attention_heads=heads, joint_attention_dim=80, caption_projection_dim=width, pooled_projection_dim=64,
        out_channels=16, pos_embed_max_size=max(2 * latent, 16), qk_norm=qk_norm)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16), layers_per_block=1,
        latent_channels=16, norm_num_groups=8, sample_size=8 * latent, scaling_factor=SD3_SCALING,
        shift_factor=SD3_SHIFT, use_quant_conv=False, use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                                    tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                                    text_encoder_3=t5, tokenizer_3=tokenizer_3)
    pipe.save_pretrained(directory)
    for sub, vocab in (("tokenizer", vocab_l), ("tokenizer_2", vocab_g)):
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(vocab / name, directory / sub / name)
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--latent", type=int, default=64, help="native latent side (images are 8x larger)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args(argv)
    build_tiny_sd3(args.out, latent=args.latent, layers=args.layers, width=args.width)
    print(args.out)


if __name__ == "__main__":
    main()
