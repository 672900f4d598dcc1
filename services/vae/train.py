"""``genserve train vae``: train the autoencoder on freshly rendered shapes
(also ``python -m genserve.services.vae.train``).

Seeded: step s trains on ``sample_batch(batch_size, seed=seed·10⁶ + s)``, so a resumed run sees the same data as an
uninterrupted one. Resumable: the run directory holds the latest checkpoint (config.json + model.safetensors) and the
optimizer state; running again with the same ``--run-dir`` continues from its step up to ``--steps``. Every
``--sample-every`` steps a grid (top rows: held-out inputs, bottom rows: reconstructions) lands in
``<run-dir>/samples/``. At the end the latent scale factor (1 / std of posterior means over training images) is
measured, held-out PSNR evaluated, and the weights exported to ``--out`` (default services/vae/weights/).
``--freeze-encoder`` continues training the decoder alone: the latent space, and so any diffusion model trained in
it, is left untouched.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from genserve.services.shapes.dataset import sample_batch
from genserve.services.shapes.grid import save_grid
from genserve.services.shapes.train_state import has_train_state, load_train_state, save_train_state
from genserve.services.vae.evaluate import evaluate, reconstruct_in_batches
from genserve.services.vae.model import DEFAULT_WEIGHTS
from genserve.shared.blocks.autoencoder import VAE, VAEConfig
from genserve.shared.checkpoint import load_weights, read_config, save_checkpoint

DATA_SEED_STRIDE = 1_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", type=Path, default=Path("runs/vae"), help="checkpoint + optimizer state (resume)")
    parser.add_argument("--out", type=Path, default=DEFAULT_WEIGHTS, help="where the final weights are exported")
    parser.add_argument("--steps", type=int, default=2000, help="total optimizer steps (a resumed run continues)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--channels", type=str, default="16,32,64", help="block_out_channels, comma separated")
    parser.add_argument("--kl-weight", type=float, default=VAEConfig.kl_weight)
    parser.add_argument("--sample-every", type=int, default=250)
    parser.add_argument("--save-every", type=int, default=250)
    parser.add_argument("--time-limit", type=float, default=0.0, help="minutes; stop (and save) after this, 0 = none")
    parser.add_argument("--eval-images", type=int, default=1000)
    parser.add_argument("--scale-images", type=int, default=2000, help="training images to measure scaling_factor on")
    parser.add_argument(
        "--freeze-encoder",
        action="store_true",
        help="train only the decoder: latents (and scaling_factor) stay exactly as they are, so a diffusion model "
        "trained on them stays valid while reconstructions improve",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--no-progress", action="store_true", help="disable the tqdm progress bar")


def _learning_rate(step: int, total: int, peak: float, warmup: int = 100) -> float:
    """Linear warm-up, then cosine decay to 5% of the peak at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def _restore_or_build(args: argparse.Namespace) -> tuple[VAE, torch.optim.Optimizer, dict]:
    if has_train_state(args.run_dir):
        vae = VAE(read_config(args.run_dir, VAEConfig))
        load_weights(args.run_dir, vae)
        optimizer = torch.optim.AdamW(vae.parameters(), lr=args.lr, weight_decay=0.0)
        counters = load_train_state(args.run_dir, {"adamw": optimizer})
        return vae, optimizer, counters
    torch.manual_seed(args.seed)
    channels = tuple(int(c) for c in args.channels.split(","))
    vae = VAE(VAEConfig(block_out_channels=channels, kl_weight=args.kl_weight))
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.lr, weight_decay=0.0)
    return vae, optimizer, {"step": 0, "images_seen": 0, "train_seconds": 0.0}


def _save(args: argparse.Namespace, vae: VAE, optimizer: torch.optim.Optimizer, counters: dict) -> None:
    save_checkpoint(args.run_dir, vae, vae.config, extra={"train": counters})
    save_train_state(args.run_dir, {"adamw": optimizer}, counters)


@torch.no_grad()
def measure_scaling_factor(vae: VAE, n_images: int = 2000, seed: int = 12345) -> float:
    """1 / std of the posterior means over training images, so scaled latents have unit variance (LDM §3)."""
    images, _, _ = sample_batch(n_images, seed=seed, split="train")
    means = torch.cat([vae.encode(chunk)[0] for chunk in images.split(250)])
    return float(1.0 / means.std())


def _sample_grid(args: argparse.Namespace, vae: VAE, step: int) -> None:
    images, _, _ = sample_batch(16, seed=args.seed, split="heldout")
    recon = reconstruct_in_batches(vae.eval(), images)
    save_grid(torch.cat([images, recon]), args.run_dir / "samples" / f"step_{step:06d}.png", n_cols=16)
    vae.train()


def export(args: argparse.Namespace, vae: VAE, counters: dict) -> dict:
    """Measure the scale factor and held-out metrics, then write the serving weights to ``args.out``."""
    vae.eval()
    config = dataclasses.replace(vae.config, scaling_factor=measure_scaling_factor(vae, args.scale_images))
    vae.config = config
    metrics = evaluate(vae, n_images=args.eval_images, seed=0)
    save_checkpoint(args.out, vae, config, extra={"train": counters, "metrics": metrics})
    return metrics


def run(args: argparse.Namespace) -> dict:
    """Train (or resume) to ``args.steps`` steps, export the weights, return the held-out metrics."""
    torch.set_num_threads(args.threads)
    vae, optimizer, counters = _restore_or_build(args)
    vae.train()
    for module in (vae.encoder, vae.quant_conv):
        module.requires_grad_(not args.freeze_encoder)
    noise = torch.Generator()
    started, budget, seconds_before = time.monotonic(), args.time_limit * 60, counters["train_seconds"]
    first = counters["step"]
    bar = tqdm(range(first, args.steps), initial=first, total=args.steps, disable=args.no_progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, args.steps, args.lr)
        images, _, _ = sample_batch(args.batch_size, seed=args.seed * DATA_SEED_STRIDE + step)
        noise.manual_seed(args.seed * DATA_SEED_STRIDE + step)  # per-step noise: a resumed run repeats it exactly
        losses = vae.loss(images, generator=noise)
        optimizer.zero_grad(set_to_none=True)
        losses["loss"].backward()
        optimizer.step()
        psnr_batch = 10 * math.log10(4.0 / max(losses["mse"].item(), 1e-12))
        bar.set_postfix(loss=f"{losses['loss'].item():.5f}", kl=f"{losses['kl'].item():.2f}", psnr=f"{psnr_batch:.1f}")
        counters = {
            "step": step + 1,
            "images_seen": counters["images_seen"] + args.batch_size,
            "train_seconds": round(seconds_before + time.monotonic() - started, 1),
        }
        if (step + 1) % args.sample_every == 0:
            _sample_grid(args, vae, step + 1)
        out_of_time = budget > 0 and time.monotonic() - started > budget
        if (step + 1) % args.save_every == 0 or out_of_time:
            _save(args, vae, optimizer, counters)
        if out_of_time:
            break
    _save(args, vae, optimizer, counters)
    metrics = export(args, vae, counters)
    print({"step": counters["step"], **{k: round(v, 4) for k, v in metrics.items()}})
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="genserve train vae", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
