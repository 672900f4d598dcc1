"""Random tiny Stable-Diffusion-format pipelines, built with diffusers' and transformers' own classes and saved
with ``save_pretrained``: the reference side of the parity tests and of ``bench/diffusion.py --model``.

SD-shaped: a UNet2DConditionModel with channels (32, 64, 64), cross-attention at the first two levels (width 64,
``attention_head_dim`` 8 meaning 8 heads, 1×1-conv projections as in SD 1.x), an AutoencoderKL with mid-block
attention and 8× downsampling, a 2-layer CLIPTextModel, a byte-level BPE vocabulary trained here on captions, and
SD 1.x's DDIM scheduler settings.

    python -m tests.services.diffusion.tiny_sd OUT_DIR [--latent 64] [--layers-per-block 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
CAPTIONS = [
    "a large red circle at the top left", "a small blue square in the center", "an astronaut riding a horse",
    "A photograph of a cat, sitting on the windowsill!", "sunset over the mountains, oil painting",
    "portrait of an old man with a beard", "cyberpunk city at night, neon lights, rain",
    "the quick brown fox jumps over the lazy dog", "bowl of fruit: apples, pears and grapes",
    "a watercolor of a lighthouse in the storm", "macro photo of a dew drop on a leaf", "two dogs playing in snow",
]


def write_clip_vocab(directory: Path, pad_token: str = EOS, n_merges: int = 300) -> Path:
    """vocab.json (CLIP's layout: 256 byte symbols, the same with ``</w>``, merged pieces, then the two specials),
    merges.txt learned from CAPTIONS by the `tokenizers` BPE trainer, and tokenizer_config.json."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    words = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
    trainer_tok = Tokenizer(BPE(continuing_subword_prefix="", end_of_word_suffix="</w>"))
    trainer_tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                                   normalizers.Lowercase()])
    trainer_tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(words), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) * 2 + n_merges, initial_alphabet=alphabet,
                                  end_of_word_suffix="</w>", show_progress=False)
    trainer_tok.train_from_iterator(CAPTIONS * 4, trainer)
    merges = json.loads(trainer_tok.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    tokens = alphabet + [c + "</w>" for c in alphabet]
    tokens += [a + b for a, b in merges if a + b not in set(tokens)]
    tokens += [BOS, EOS]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(dict.fromkeys(tokens))}))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "bos_token": BOS, "eos_token": EOS,
        "unk_token": EOS, "pad_token": pad_token, "do_lower_case": True}))
    return directory


def build_tiny_sd(directory: Path, *, latent: int = 16, layers_per_block: int = 1, prediction_type: str = "epsilon",
                  seed: int = 0, inpainting: bool = False) -> Path:
    """Save a random StableDiffusionPipeline into ``directory`` (native size ``8 * latent`` pixels); ``inpainting``:
    a StableDiffusionInpaintPipeline whose U-Net takes 9 channels (latents, mask, masked image's latents)."""
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionInpaintPipeline,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    directory = Path(directory)
    vocab_dir = write_clip_vocab(directory.parent / f"{directory.name}-vocab")
    tokenizer = CLIPTokenizer.from_pretrained(vocab_dir)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=latent, in_channels=9 if inpainting else 4, out_channels=4, block_out_channels=(32, 64, 64),
        layers_per_block=layers_per_block,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64,
        attention_head_dim=8, norm_num_groups=32)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=8, sample_size=8 * latent)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1, prediction_type=prediction_type)
    cls = StableDiffusionInpaintPipeline if inpainting else StableDiffusionPipeline
    pipe = cls(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
               safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(directory)
    # Released checkpoints ship vocab.json + merges.txt; keep that form in the saved folder too.
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(vocab_dir / name, directory / "tokenizer" / name)
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--latent", type=int, default=64, help="native latent side (images are 8x larger)")
    parser.add_argument("--layers-per-block", type=int, default=2)
    parser.add_argument("--prediction-type", default="epsilon", choices=("epsilon", "v_prediction"))
    args = parser.parse_args(argv)
    build_tiny_sd(args.out, latent=args.latent, layers_per_block=args.layers_per_block,
                  prediction_type=args.prediction_type)
    print(args.out)


if __name__ == "__main__":
    main()
