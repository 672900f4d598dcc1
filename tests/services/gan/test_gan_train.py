from __future__ import annotations

import argparse

import torch
from safetensors.torch import load_file

from genserve.services.gan import train
from genserve.services.gan.model import load_generator
from genserve.shared.checkpoint import read_extra


def _args(run_dir, out, steps: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser.parse_args(
        [
            f"--run-dir={run_dir}",
            f"--out={out}",
            f"--steps={steps}",
            "--batch-size=4",
            "--z-dim=32",
            "--condition=shape_colour",
            "--space=pixel",
            "--g-channels=16,8,8,4",
            "--d-channels=4,8,8",
            "--sample-every=2",
            "--save-every=2",
            "--eval-draws=8",
            "--log-draws=8",
            "--no-progress",
        ]
    )


def test_resumed_run_matches_an_uninterrupted_one(tmp_path):
    train.run(_args(tmp_path / "straight", tmp_path / "out_a", steps=4))
    train.run(_args(tmp_path / "resumed", tmp_path / "out_b", steps=2))
    train.run(_args(tmp_path / "resumed", tmp_path / "out_b", steps=4))
    a = load_file(str(tmp_path / "out_a" / "model.safetensors"))
    b = load_file(str(tmp_path / "out_b" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_run_exports_the_better_generator_with_both_scores(tmp_path):
    metrics = train.run(_args(tmp_path / "run", tmp_path / "out", steps=2))
    extra = read_extra(tmp_path / "out")
    assert extra["train"]["step"] == 2 and extra["metrics"] == metrics
    assert set(metrics) == {"ema", "raw"} and set(metrics[extra["exported"]]) == {"validity", "coverage"}
    score = {name: m["validity"] + m["coverage"] for name, m in metrics.items()}
    assert score[extra["exported"]] == max(score.values())
    assert load_generator(tmp_path / "out").config.z_dim == 32
    assert (tmp_path / "run" / "samples" / "step_000002.png").exists()


def test_ema_update_interpolates_parameters_and_copies_buffers():
    config = train.GANConfig(z_dim=8, g_channels=(16, 8, 8, 4), d_channels=(4, 8, 8))
    ema, model = train.Generator(config), train.Generator(config)
    with torch.no_grad():
        for p in ema.parameters():
            p.fill_(0.0)
        for p in model.parameters():
            p.fill_(1.0)
        model.project_norm.running_mean.fill_(3.0)
    train.update_ema(ema, model, decay=0.9)
    torch.testing.assert_close(ema.project.weight, torch.full_like(ema.project.weight, 0.1))
    torch.testing.assert_close(ema.project_norm.running_mean, torch.full((16,), 3.0))


def test_latent_space_run_uses_the_vae_decoder_and_exports(tmp_path):
    from genserve.shared.blocks.autoencoder import VAE, VAEConfig
    from genserve.shared.checkpoint import save_checkpoint

    vae_config = VAEConfig(block_out_channels=(8, 16, 16), norm_groups=4, scaling_factor=0.5)
    vae = VAE(vae_config)
    save_checkpoint(tmp_path / "vae", vae, vae_config)
    args = _args(tmp_path / "run", tmp_path / "out", steps=2)
    args.space, args.vae, args.g_channels, args.d_channels = "latent", tmp_path / "vae", "16,8", "8"
    train.run(args)
    generator = load_generator(tmp_path / "out")
    assert generator.config.space == "latent" and generator.config.vae_scaling_factor == 0.5
    torch.testing.assert_close(generator.decoder.conv_out.weight, vae.decoder.conv_out.weight)
