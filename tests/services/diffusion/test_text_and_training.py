"""Tokenizer, text encoder and the training pieces: preview fit, EMA, loss target, a short resumable run."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from services.diffusion import train
from services.diffusion.model import LatentDiffusion, load_diffusion
from services.diffusion.schedulers.schedule import alphas_cumprod
from services.diffusion.text_encoder import TextEncoder, TextEncoderConfig
from services.diffusion.tokenizer import WordTokenizer, caption_vocabulary
from services.shapes.dataset import all_attribute_combinations, caption
from services.vae.model import VAE, VAEConfig
from shared.checkpoint import read_extra, save_checkpoint


def test_every_dataset_caption_is_in_vocabulary() -> None:
    tok = WordTokenizer(caption_vocabulary(), max_length=12)
    for attrs in all_attribute_combinations():
        text = caption(attrs)
        assert tok.unknown_words(text) == []
        assert tok.unk_id not in tok.encode(text)


def test_tokenizer_bos_padding_unknown_and_truncation() -> None:
    tok = WordTokenizer(caption_vocabulary(), max_length=6)
    ids = tok(["A RED, circle!", "", "a zebra"])
    vocab = caption_vocabulary()
    assert ids[0].tolist() == [tok.bos_id, vocab.index("a"), vocab.index("red"), vocab.index("circle"), 0, 0]
    assert ids[1].tolist() == [tok.bos_id] + [tok.pad_id] * 5
    assert ids[2, 2].item() == tok.unk_id
    assert len(tok.encode("a b c d e f g h")) == 6


def test_text_encoder_is_bidirectional() -> None:
    """A later word changes the features of an earlier position (no causal mask)."""
    vocab = caption_vocabulary()
    enc = TextEncoder(TextEncoderConfig(vocab_size=len(vocab), dim=16, n_layers=1, n_heads=2)).eval()
    tok = WordTokenizer(vocab, 12)
    with torch.no_grad():
        a, b = enc(tok(["a red circle", "a red square"]))
    assert (a[1] - b[1]).abs().max() > 1e-4  # position 1 is "a", before the differing word


def test_fit_preview_recovers_a_linear_map(tiny_model: LatentDiffusion) -> None:
    weight, bias = torch.randn(3, 4), torch.randn(3)
    latents = torch.randn(50, 4, 8, 8)
    images = torch.einsum("oc,nchw->nohw", weight, latents) + bias[None, :, None, None]
    train.fit_preview(tiny_model, latents, images)
    torch.testing.assert_close(tiny_model.preview.weight[:, :, 0, 0], weight, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tiny_model.preview.bias, bias, rtol=1e-4, atol=1e-4)


def test_ema_update_moves_toward_the_model(tiny_model: LatentDiffusion) -> None:
    ema = LatentDiffusion(tiny_model.config)
    p_ema, p = next(ema.parameters()), next(tiny_model.parameters())
    before = p_ema.detach().clone()
    train.ema_update(ema, tiny_model, decay=0.9, step=1000)
    torch.testing.assert_close(p_ema, 0.9 * before + 0.1 * p.detach(), rtol=1e-6, atol=1e-6)


def test_loss_is_zero_for_a_perfect_v_predictor(tiny_model: LatentDiffusion) -> None:
    """The regression target is v = √ᾱ ε − √(1−ᾱ) z: a U-Net returning exactly that has zero loss."""
    config = tiny_model.config
    abar = alphas_cumprod(config.schedule)
    z, ids = torch.randn(4, 4, 8, 8), tiny_model.tokenizer()(["a red circle"] * 4)
    gen_a, gen_b = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    noise = torch.randn(z.shape, generator=gen_b)
    t = torch.randint(0, config.schedule.num_train_timesteps, (4,), generator=gen_b)
    a = abar[t][:, None, None, None]
    oracle = a.sqrt() * noise - (1 - a).sqrt() * z
    tiny_model.unet.forward = lambda x_t, tt, ctx: oracle  # type: ignore[method-assign]
    assert train.training_loss(tiny_model, config, abar, z, ids, gen_a).item() < 1e-10


def test_short_training_run_resumes_and_exports(tmp_path: Path) -> None:
    vae_dir = tmp_path / "vae"
    torch.manual_seed(0)
    save_checkpoint(vae_dir, VAE(VAEConfig(block_out_channels=(8, 8, 8), norm_groups=4, scaling_factor=0.7)),
                    VAEConfig(block_out_channels=(8, 8, 8), norm_groups=4, scaling_factor=0.7))
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    common = ["--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--vae", str(vae_dir),
              "--pool-size", "64", "--batch-size", "8", "--channels", "32", "--text-dim", "32",
              "--sample-every", "1000", "--eval-every", "1000", "--final-eval-prompts", "2", "--no-progress"]
    train.run(parser.parse_args(common + ["--steps", "2"]))
    metrics = train.run(parser.parse_args(common + ["--steps", "3"]))
    exported = load_diffusion(tmp_path / "out")
    assert exported.config.scaling_factor == 0.7
    assert read_extra(tmp_path / "out")["train"]["step"] == 3
    assert read_extra(tmp_path / "run")["train"]["images_seen"] == 3 * 8
    assert set(metrics) >= {"colour", "shape", "size", "position", "all"}


def test_evaluate_scores_heldout_prompts_with_the_reader(tiny_pipe) -> None:
    from services.diffusion.evaluate import evaluate, heldout_prompts

    prompts, attrs = heldout_prompts(5, seed=0)
    assert prompts == heldout_prompts(5, seed=0)[0] and prompts != heldout_prompts(5, seed=1)[0]
    assert all(caption(a) == p for a, p in zip(attrs, prompts, strict=True))
    torch.manual_seed(0)
    vae = VAE(VAEConfig(block_out_channels=(8, 8, 8), norm_groups=4)).eval()
    result = evaluate(n_prompts=3, steps=2, pipeline=tiny_pipe, vae=vae)
    assert set(result) >= {"colour", "shape", "size", "position", "all", "seconds_per_image"}
    assert all(0.0 <= result[k] <= 1.0 for k in ("colour", "shape", "size", "position", "all"))
