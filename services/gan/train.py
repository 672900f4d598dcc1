"""``genserve train gan``: train the DCGAN on freshly rendered shapes (also ``python -m genserve.services.gan.train``).

By default the GAN works in the VAE's latent space (``--space latent``, see genserve.services.gan.model): it needs the
trained VAE (``--vae``, default services/vae/weights/), whose encoder makes the real latents and whose decoder is
copied, frozen, into the generator. Hinge loss, Adam(β1=0, β2=0.9) as in SN-GAN, one discriminator step per
generator step, and an exponential moving average of the generator's weights (usually the generator exported and
served: its samples are steadier).
Seeded: step s trains on ``sample_batch(batch_size, seed=seed·10⁶ + s)``. Resumable: ``--run-dir`` holds the
generator, EMA generator and discriminator checkpoints plus both optimizers' state; running again continues to
``--steps``. Every ``--sample-every`` steps a grid of EMA samples for fixed latents lands in ``<run-dir>/samples/``
and validity/coverage over ``--log-draws`` draws is logged. At the end the EMA generator (BatchNorm statistics
recalibrated) and the raw generator are both scored on 1,000 draws, and the better one is exported to ``--out``
(default services/gan/weights/); config.json records which (``exported``) and both scores.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from genserve.services.common.weights import committed_weights
from genserve.services.gan.evaluate import evaluate
from genserve.services.gan.model import (
    ALL_ATTRIBUTE_CLASSES,
    DEFAULT_WEIGHTS,
    SHAPE_COLOUR_CLASSES,
    Discriminator,
    GANConfig,
    Generator,
    class_of,
    latent_classes,
)
from genserve.services.gan.sampling import generate, recalibrate_batchnorm, sample_latents
from genserve.services.shapes.dataset import sample_batch
from genserve.services.shapes.grid import save_grid
from genserve.services.shapes.train_state import has_train_state, load_train_state, save_train_state
from genserve.shared.blocks.autoencoder import VAE, load_autoencoder
from genserve.shared.checkpoint import load_weights, read_config, save_checkpoint

DATA_SEED_STRIDE = 1_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", type=Path, default=Path("runs/gan"), help="checkpoints + optimizer state (resume)")
    parser.add_argument("--out", type=Path, default=DEFAULT_WEIGHTS, help="where the exported generator goes")
    parser.add_argument("--steps", type=int, default=4800, help="total generator steps (a resumed run continues)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--ema", type=float, default=0.998, help="EMA decay of the averaged generator")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--z-dim", type=int, default=256, help="must be >= the number of classes (240 for 'all')")
    parser.add_argument(
        "--space",
        choices=("latent", "pixel"),
        default="latent",
        help="latent: draw VAE latents rendered by the frozen VAE decoder (the demo model); pixel: a plain DCGAN",
    )
    parser.add_argument("--vae", type=Path, default=committed_weights("vae"), help="VAE checkpoint for --space latent")
    parser.add_argument("--g-channels", type=str, default=None, help="default 128,64 (latent) / 96,64,32,16 (pixel)")
    parser.add_argument("--d-channels", type=str, default=None, help="default 128 (latent) / 32,64,128 (pixel)")
    parser.add_argument(
        "--condition",
        choices=("shape_colour", "all", "none"),
        default="all",
        help="classes read off the latent (genserve.services.gan.model): shape×colour, all four attributes, or none",
    )
    parser.add_argument("--sample-every", type=int, default=250)
    parser.add_argument("--save-every", type=int, default=250)
    parser.add_argument("--time-limit", type=float, default=0.0, help="minutes; stop (and save) after this, 0 = none")
    parser.add_argument("--eval-draws", type=int, default=1000)
    parser.add_argument("--log-draws", type=int, default=200, help="draws scored at every sample grid")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--no-progress", action="store_true", help="disable the tqdm progress bar")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(c) for c in text.split(","))


def _optimizers(generator: Generator, discriminator: Discriminator, lr: float) -> dict[str, torch.optim.Optimizer]:
    return {
        "g": torch.optim.Adam(generator.parameters(), lr=lr, betas=(0.0, 0.9)),
        "d": torch.optim.Adam(discriminator.parameters(), lr=lr, betas=(0.0, 0.9)),
    }


DEFAULT_CHANNELS = {"latent": ("128,64", "128"), "pixel": ("96,64,32,16", "32,64,128")}


def _build_config(args: argparse.Namespace, vae: VAE | None) -> GANConfig:
    g_default, d_default = DEFAULT_CHANNELS[args.space]
    fields = {
        "z_dim": args.z_dim,
        "g_channels": _ints(args.g_channels or g_default),
        "d_channels": _ints(args.d_channels or d_default),
        "n_classes": {"none": 0, "shape_colour": SHAPE_COLOUR_CLASSES, "all": ALL_ATTRIBUTE_CLASSES}[args.condition],
        "space": args.space,
    }
    if vae is not None:
        fields.update(
            vae_block_out_channels=vae.config.block_out_channels,
            vae_layers_per_block=vae.config.layers_per_block,
            vae_norm_groups=vae.config.norm_groups,
            vae_latent_channels=vae.config.latent_channels,
            vae_scaling_factor=vae.scaling_factor,
        )
    return GANConfig(**fields)


def _restore_or_build(
    args: argparse.Namespace, vae: VAE | None
) -> tuple[Generator, Generator, Discriminator, dict, dict]:
    if has_train_state(args.run_dir):
        config = read_config(args.run_dir / "generator", GANConfig)
        generator, ema, discriminator = Generator(config), Generator(config), Discriminator(config)
        load_weights(args.run_dir / "generator", generator)
        load_weights(args.run_dir / "generator_ema", ema)
        load_weights(args.run_dir / "discriminator", discriminator)
        optimizers = _optimizers(generator, discriminator, args.lr)
        counters = load_train_state(args.run_dir, optimizers)
        return generator, ema, discriminator, optimizers, counters
    torch.manual_seed(args.seed)
    config = _build_config(args, vae)
    generator, discriminator = Generator(config), Discriminator(config)
    if vae is not None:  # the renderer is the trained VAE's decoder, frozen
        generator.decoder.load_state_dict(vae.decoder.state_dict())
        generator.post_quant_conv.load_state_dict(vae.post_quant_conv.state_dict())
    ema = copy.deepcopy(generator)
    counters = {"step": 0, "images_seen": 0, "train_seconds": 0.0}
    return generator, ema, discriminator, _optimizers(generator, discriminator, args.lr), counters


@torch.no_grad()
def update_ema(ema: Generator, generator: Generator, decay: float) -> None:
    """θ_ema ← decay·θ_ema + (1 - decay)·θ; BatchNorm running statistics are copied, not averaged."""
    for target, source in zip(ema.parameters(), generator.parameters(), strict=True):
        target.lerp_(source, 1.0 - decay)
    for target, source in zip(ema.buffers(), generator.buffers(), strict=True):
        target.copy_(source)


def train_step(
    generator: Generator,
    discriminator: Discriminator,
    optimizers: dict[str, torch.optim.Optimizer],
    real: torch.Tensor,
    real_labels: torch.Tensor | None,
    noise: torch.Generator,
) -> dict[str, float]:
    """One hinge-loss discriminator step and one generator step (module docstring of genserve.services.gan.model).

    ``real`` is what the generator network draws: images, or scaled VAE latents for a latent-space GAN.
    """
    z = torch.randn(real.shape[0], generator.config.z_dim, generator=noise)
    fake = generator.features(z)
    n_classes = generator.config.n_classes
    fake_labels = latent_classes(z, n_classes) if n_classes else None
    d_real, d_fake = discriminator(real, real_labels), discriminator(fake.detach(), fake_labels)
    d_loss = F.relu(1 - d_real).mean() + F.relu(1 + d_fake).mean()
    optimizers["d"].zero_grad(set_to_none=True)
    d_loss.backward()
    optimizers["d"].step()
    g_loss = -discriminator(fake, fake_labels).mean()
    optimizers["g"].zero_grad(set_to_none=True)
    g_loss.backward()
    optimizers["g"].step()
    return {"d_loss": d_loss.item(), "g_loss": g_loss.item()}


def _save(args, generator, ema, discriminator, optimizers, counters) -> None:
    for name, module in (("generator", generator), ("generator_ema", ema), ("discriminator", discriminator)):
        save_checkpoint(args.run_dir / name, module, module.config, extra={"train": counters})
    save_train_state(args.run_dir, optimizers, counters)


def export_choice(generator: Generator, ema: Generator, n_draws: int) -> tuple[str, Generator, dict[str, dict]]:
    """Score the EMA generator (BatchNorm recalibrated) and the raw one on the same draws; keep the better.

    Early in training, or with a fast-moving generator, the weight average can lag behind the raw weights; the
    choice and both scores go into config.json so the export says which one it is.
    """
    candidates = {"ema": copy.deepcopy(ema), "raw": copy.deepcopy(generator).eval()}
    recalibrate_batchnorm(candidates["ema"])
    metrics = {name: evaluate(model, n_draws=n_draws, seed=0) for name, model in candidates.items()}
    best = max(metrics, key=lambda name: metrics[name]["validity"] + metrics[name]["coverage"])
    return best, candidates[best], metrics


def _log_samples(args: argparse.Namespace, ema: Generator, step: int) -> dict:
    ema = copy.deepcopy(ema)
    recalibrate_batchnorm(ema)
    z = sample_latents(64, seed=args.seed, z_dim=ema.config.z_dim)
    save_grid(generate(ema, z), args.run_dir / "samples" / f"step_{step:06d}.png", n_cols=8)
    return evaluate(ema, n_draws=args.log_draws, seed=args.seed + 1)


def run(args: argparse.Namespace) -> dict:
    """Train (or resume) to ``args.steps`` steps, export the EMA generator, return its metrics over 1,000 draws."""
    torch.set_num_threads(args.threads)
    vae = load_autoencoder(args.vae) if args.space == "latent" else None
    generator, ema, discriminator, optimizers, counters = _restore_or_build(args, vae)
    generator.train()
    discriminator.train()
    noise = torch.Generator()
    started, budget, seconds_before = time.monotonic(), args.time_limit * 60, counters["train_seconds"]
    first = counters["step"]
    bar = tqdm(range(first, args.steps), initial=first, total=args.steps, disable=args.no_progress)
    for step in bar:
        real, _, attrs = sample_batch(args.batch_size, seed=args.seed * DATA_SEED_STRIDE + step)
        n_classes = generator.config.n_classes
        labels = torch.tensor([class_of(a, n_classes) for a in attrs]) if n_classes else None
        if vae is not None:
            with torch.no_grad():
                real = vae.encode(real)[0] * vae.scaling_factor  # (B, 4, 8, 8) posterior means, unit variance
        noise.manual_seed(args.seed * DATA_SEED_STRIDE + step)  # per-step noise: a resumed run repeats it exactly
        losses = train_step(generator, discriminator, optimizers, real, labels, noise)
        update_ema(ema, generator, args.ema if step >= 100 else 0.0)
        bar.set_postfix(d=f"{losses['d_loss']:.3f}", g=f"{losses['g_loss']:.3f}")
        counters = {
            "step": step + 1,
            "images_seen": counters["images_seen"] + args.batch_size,
            "train_seconds": round(seconds_before + time.monotonic() - started, 1),
        }
        if (step + 1) % args.sample_every == 0:
            bar.write(f"step {step + 1}: {_log_samples(args, ema, step + 1)}")
        out_of_time = budget > 0 and time.monotonic() - started > budget
        if (step + 1) % args.save_every == 0 or out_of_time:
            _save(args, generator, ema, discriminator, optimizers, counters)
        if out_of_time:
            break
    _save(args, generator, ema, discriminator, optimizers, counters)
    name, chosen, metrics = export_choice(generator, ema, args.eval_draws)
    save_checkpoint(args.out, chosen, chosen.config, extra={"train": counters, "exported": name, "metrics": metrics})
    print({"step": counters["step"], "exported": name, **metrics[name]})
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="genserve train gan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
