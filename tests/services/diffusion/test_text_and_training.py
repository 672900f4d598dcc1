"""Tokenizer, text encoder and the training pieces: preview fit, EMA, loss target, a short resumable run."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from genserve.services.diffusion import train
from genserve.services.diffusion.model import LatentDiffusion, load_diffusion
from genserve.services.diffusion.schedulers.schedule import alphas_cumprod
from genserve.services.diffusion.text_encoder import TextEncoder, TextEncoderConfig
from genserve.services.diffusion.tokenizer import WordTokenizer, caption_vocabulary
from genserve.services.shapes.dataset import all_attribute_combinations, caption
from genserve.shared.blocks.autoencoder import VAE, VAEConfig
from genserve.shared.checkpoint import read_extra, save_checkpoint


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


def tiny_training(tmp_path: Path) -> tuple[argparse.ArgumentParser, list[str]]:
    """The training command's parser and the arguments of a seconds-long run on a random tiny VAE (scaling 0.7)."""
    vae_dir = tmp_path / "vae"
    torch.manual_seed(0)
    save_checkpoint(vae_dir, VAE(VAEConfig(block_out_channels=(8, 8, 8), norm_groups=4, scaling_factor=0.7)),
                    VAEConfig(block_out_channels=(8, 8, 8), norm_groups=4, scaling_factor=0.7))
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser, ["--vae", str(vae_dir), "--pool-size", "64", "--batch-size", "8", "--channels", "32",
                    "--text-dim", "32", "--sample-every", "1000", "--eval-every", "1000", "--final-eval-prompts", "2",
                    "--no-progress"]


def test_short_training_run_resumes_and_exports(tmp_path: Path) -> None:
    parser, tiny = tiny_training(tmp_path)
    common = ["--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out"), *tiny]
    train.run(parser.parse_args(common + ["--steps", "2"]))
    metrics = train.run(parser.parse_args(common + ["--steps", "3"]))
    exported = load_diffusion(tmp_path / "out")
    assert exported.config.scaling_factor == 0.7
    assert read_extra(tmp_path / "out")["train"]["step"] == 3
    assert read_extra(tmp_path / "run")["train"]["images_seen"] == 3 * 8
    assert set(metrics) >= {"colour", "shape", "size", "position", "all"}


def test_evaluate_scores_heldout_prompts_with_the_reader(tiny_pipe) -> None:
    from genserve.services.diffusion.evaluate import evaluate, heldout_prompts

    prompts, attrs = heldout_prompts(5, seed=0)
    assert prompts == heldout_prompts(5, seed=0)[0] and prompts != heldout_prompts(5, seed=1)[0]
    assert all(caption(a) == p for a, p in zip(attrs, prompts, strict=True))
    torch.manual_seed(0)
    vae = VAE(VAEConfig(block_out_channels=(8, 8, 8), norm_groups=4)).eval()
    result = evaluate(n_prompts=3, steps=2, pipeline=tiny_pipe, vae=vae)
    assert set(result) >= {"colour", "shape", "size", "position", "all", "seconds_per_image"}
    assert all(0.0 <= result[k] <= 1.0 for k in ("colour", "shape", "size", "position", "all"))


def test_training_captions_keep_random_non_empty_subsets() -> None:
    attrs = [{"size": "large", "colour": "yellow", "shape": "circle", "position": "top left"}] * 3000
    full = "a large yellow circle at the top left"
    gen = torch.Generator().manual_seed(0)
    assert train.training_captions(attrs[:5], 0.0, gen) == [full] * 5
    assert gen.initial_seed() == 0 and torch.rand(1, generator=gen).item() == \
        torch.rand(1, generator=torch.Generator().manual_seed(0)).item()  # p = 0 drew nothing
    texts = train.training_captions(attrs, 0.5, torch.Generator().manual_seed(1))
    partial = [t for t in texts if t != full]
    # half keep a subset; 1 in 15 of those is the full set again, so 0.5 * 14 / 15 of all differ
    assert abs(len(partial) / len(texts) - 0.5 * 14 / 15) < 0.03
    assert "" not in texts
    assert {"a yellow circle", "a circle at the top left", "a large circle at the top left", "at the top left",
            "a large", "a yellow"} <= set(partial)
    assert len(set(texts)) == 15
    assert texts == train.training_captions(attrs, 0.5, torch.Generator().manual_seed(1))  # seeded


def test_insert_unknown_words() -> None:
    tok = WordTokenizer(caption_vocabulary(), max_length=12)
    ids = tok(["a red circle", "", "a large red circle at the top left"])
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(train.insert_unknown_words(ids, tok, 0.0, gen), ids)
    out = train.insert_unknown_words(ids, tok, 1.0, torch.Generator().manual_seed(0))
    vocab = caption_vocabulary()
    for before, after in zip(ids.tolist(), out.tolist(), strict=True):
        assert after[0] == tok.bos_id and after[1] != tok.unk_id  # the first word stays first
        assert 1 <= after.count(tok.unk_id) <= 2
        # without the unknown ids it is the caption again ("a" for the empty one), in order
        words = [i for i in before if i != tok.pad_id] if before[1] != tok.pad_id else [tok.bos_id, vocab.index("a")]
        assert [i for i in after if i not in (tok.unk_id, tok.pad_id)] == words
    assert out[1, :2].tolist() == [tok.bos_id, vocab.index("a")]


def test_init_fine_tunes_exported_weights_in_a_fresh_run_dir(tmp_path: Path) -> None:
    parser, common = tiny_training(tmp_path)
    train.run(parser.parse_args(common + ["--run-dir", str(tmp_path / "a"), "--out", str(tmp_path / "w"),
                                          "--steps", "2"]))
    base = load_diffusion(tmp_path / "w")
    # --init with --lr 0: the exported model comes back unchanged (float16 -> float32 -> float16), in a new run dir
    train.run(parser.parse_args(common + ["--run-dir", str(tmp_path / "b"), "--out", str(tmp_path / "w2"),
                                          "--init", str(tmp_path / "w"), "--steps", "2", "--lr", "0",
                                          "--partial-captions", "0.5", "--unknown-words", "0.2",
                                          "--channels", "16,32"]))
    tuned = load_diffusion(tmp_path / "w2")
    assert tuned.config == base.config  # the init's config, not --channels
    for (name, a), b in zip(base.state_dict().items(), tuned.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    extra = read_extra(tmp_path / "b")["train"]
    assert extra["step"] == 2 and extra["init"]["train"]["step"] == 2
    assert extra["init"]["weights"] == str(tmp_path / "w")
