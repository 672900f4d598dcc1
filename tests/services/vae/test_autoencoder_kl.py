"""diffusers' AutoencoderKL (with its mid-block attention) in our VAE: encode, decode and the round trip match
within 1e-4 at square and non-square sizes, and configs we do not implement are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from genserve.shared.blocks.autoencoder_kl import is_autoencoder_kl, load_autoencoder_kl


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    ref = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16),
                        layers_per_block=2, latent_channels=4, norm_num_groups=8, sample_size=64)
    directory = tmp_path_factory.mktemp("vae") / "vae"
    ref.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def pair(vae_dir: Path):
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(vae_dir).eval(), load_autoencoder_kl(vae_dir)


@pytest.mark.parametrize("hw", [(64, 64), (48, 80)])
def test_encode_decode_and_round_trip_match_autoencoder_kl(pair, hw: tuple[int, int]) -> None:
    ref, ours = pair
    x = torch.rand(2, 3, *hw, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        posterior = ref.encode(x).latent_dist
        mean, logvar = ours.encode(x)
        torch.testing.assert_close(mean, posterior.mean, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logvar, posterior.logvar, rtol=1e-4, atol=1e-4)
        z = torch.randn(2, 4, hw[0] // 8, hw[1] // 8, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(ours.decode(z), ref.decode(z).sample, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.reconstruct(x), ref.decode(posterior.mean).sample, rtol=1e-4, atol=1e-4)


def test_config_is_read(vae_dir: Path, pair) -> None:
    _, ours = pair
    assert is_autoencoder_kl(vae_dir)
    assert ours.config.mid_attention and ours.config.downsample_factor == 8
    assert ours.scaling_factor == pytest.approx(0.18215)


@pytest.mark.parametrize(("change", "key"), [
    ({"shift_factor": 0.1159}, "shift_factor"),
    ({"use_quant_conv": False}, "use_quant_conv"),
    ({"act_fn": "gelu"}, "act_fn"),
    ({"down_block_types": ["DownEncoderBlock2D"] * 3 + ["AttnDownEncoderBlock2D"]}, "down_block_types"),
])
def test_unsupported_configs_are_refused_by_name(vae_dir: Path, tmp_path: Path, change: dict, key: str) -> None:
    bad = tmp_path / "vae"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(dict(json.loads((vae_dir / "config.json").read_text()), **change)))
    (bad / "diffusion_pytorch_model.safetensors").write_bytes((vae_dir / "diffusion_pytorch_model.safetensors")
                                                              .read_bytes())
    with pytest.raises(ValueError, match=f"config.json: {key}="):
        load_autoencoder_kl(bad)


def test_pickled_weights_are_refused(vae_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "vae"
    bad.mkdir()
    (bad / "config.json").write_text((vae_dir / "config.json").read_text())
    (bad / "diffusion_pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="never loads pickle"):
        load_autoencoder_kl(bad)
