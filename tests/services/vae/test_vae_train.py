from __future__ import annotations

import argparse

import pytest
import torch
from safetensors.torch import load_file

from genserve.services.vae import train
from genserve.services.vae.model import load_vae
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
            "--channels=8,16,16",
            "--sample-every=2",
            "--save-every=2",
            "--eval-images=8",
            "--scale-images=16",
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


def test_run_exports_loadable_weights_with_scale_and_metrics(tmp_path):
    metrics = train.run(_args(tmp_path / "run", tmp_path / "out", steps=2))
    extra = read_extra(tmp_path / "out")
    assert extra["train"]["step"] == 2 and extra["metrics"]["psnr_db"] == pytest.approx(metrics["psnr_db"])
    vae = load_vae(tmp_path / "out")
    assert vae.scaling_factor == pytest.approx(extra["scaling_factor"]) and vae.scaling_factor != 1.0
    assert sorted(p.name for p in (tmp_path / "run" / "samples").iterdir()) == ["step_000002.png"]


def test_learning_rate_warms_up_then_decays_to_five_percent():
    assert train._learning_rate(0, 1000, 1e-3) == pytest.approx(1e-5)
    assert train._learning_rate(99, 1000, 1e-3) == pytest.approx(1e-3)
    assert train._learning_rate(1000, 1000, 1e-3) == pytest.approx(5e-5)


def test_freeze_encoder_leaves_latents_and_scale_unchanged(tmp_path):
    train.run(_args(tmp_path / "run", tmp_path / "out_a", steps=2))
    before = load_vae(tmp_path / "out_a")
    frozen = _args(tmp_path / "run", tmp_path / "out_b", steps=4)
    frozen.freeze_encoder = True
    train.run(frozen)
    after = load_vae(tmp_path / "out_b")
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(after.encode(x)[0], before.encode(x)[0], rtol=0, atol=0)
    assert after.scaling_factor == before.scaling_factor
    assert not torch.equal(after.decoder.conv_out.weight, before.decoder.conv_out.weight)
