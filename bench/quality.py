"""Image-model quality from the committed weights, as one markdown table of goal / measured / met.

    python -m bench.quality [--quick] [--skip-diffusion] [--out docs/quality.md] [--grids docs/img] [--threads 1]

Every number is read by the project's attribute reader (services/shapes/reader.py), on held-out data:
- dataset: the reader's own accuracy (all four attributes right) on 1,000 held-out dataset images;
- VAE: PSNR of reconstructions of 1,000 held-out images (and how often the reader still reads them right);
- GAN: over 1,000 seeded draws, the fraction read as one valid shape in a palette colour, and the fraction of the
  shape×colour combinations that appear among them (plain draws, and again with the truncation trick at 1.0);
- diffusion: ``services.diffusion.evaluate.evaluate(n_prompts=200, steps=20, guidance_scale=3.0, seed=0)``, the
  per-attribute prompt adherence over held-out prompts.
A model whose weights (or code) are missing gets a row that says why instead of a crash. ``--quick`` uses 200
images / draws / prompts for a fast check (the goals are stated for the full counts). ``--grids DIR`` also
writes the sample grids the docs show (shapes_*, vae_*, gan_* PNGs), from the same weights and fixed seeds.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from services.shapes.dataset import sample_batch  # noqa: E402
from services.shapes.reader import accuracy, read_batch  # noqa: E402

Row = tuple[str, str, str, str]  # metric, goal, measured, met


def _row(metric: str, value: float, goal: float | None, unit: str = "") -> Row:
    measured = f"{value:.2f}{unit}" if unit else f"{value:.3f}"
    if goal is None:
        return (metric, "–", measured, "–")
    target = f"≥ {goal:g}{unit}" if unit else f"≥ {goal:.2f}"
    return (metric, target, measured, "yes" if value >= goal else "no")


def _missing(metric: str, reason: str) -> list[Row]:
    return [(metric, "–", f"not measured: {reason}", "–")]


def dataset_rows(n: int) -> list[Row]:
    images, _, attrs = sample_batch(n, seed=0, split="heldout")
    scores = accuracy(read_batch(images), attrs)
    return [_row(f"dataset: reader accuracy, all attributes ({n} held-out images)", scores["all"], 0.98)]


def vae_rows(n: int) -> list[Row]:
    from services.vae.evaluate import evaluate
    from services.vae.model import load_vae

    metrics = evaluate(load_vae(), n_images=n, seed=0)
    return [
        _row(f"VAE: PSNR on {n} held-out images", metrics["psnr_db"], 28.0, " dB"),
        _row("VAE: reader accuracy on reconstructions, all attributes", metrics["recon_read_all"], None),
    ]


def gan_rows(n: int) -> list[Row]:
    from services.gan.evaluate import evaluate
    from services.gan.model import load_generator

    generator = load_generator()
    rows = []
    for truncation in (None, 1.0):
        metrics = evaluate(generator, n_draws=n, seed=0, truncation=truncation)
        how = f"{n} draws" + ("" if truncation is None else f", truncation {truncation:g}")
        rows += [
            _row(f"GAN: valid samples (one shape, palette colour; {how})", metrics["validity"], 0.90),
            _row(f"GAN: shape×colour coverage ({how})", metrics["coverage"], 0.90),
        ]
    return rows


def diffusion_rows(n: int) -> list[Row]:
    from services.diffusion.evaluate import evaluate

    scores = evaluate(n_prompts=n, steps=20, guidance_scale=3.0, seed=0)
    goals = {"colour": 0.95, "shape": 0.85, "position": 0.80, "size": None, "all": None}
    where = f"{n} held-out prompts, 20 steps, guidance 3"
    return [_row(f"diffusion: {attr} correct ({where})", scores[attr], goal) for attr, goal in goals.items()]


def _guarded(name: str, build: Callable[[int], list[Row]], n: int) -> list[Row]:
    """Run one section; weights or code that are not there yet become an explanatory row."""
    started = time.perf_counter()
    try:
        rows = build(n)
    except (FileNotFoundError, ModuleNotFoundError, ImportError) as error:
        return _missing(name, f"{type(error).__name__}: {error}")
    print(f"[{name}: {time.perf_counter() - started:.0f} s]", file=sys.stderr)
    return rows


def write_grids(directory: Path) -> list[Path]:
    """Dataset, VAE and GAN sample grids from fixed seeds; a model without weights is skipped."""
    from services.shapes.grid import save_grid

    images, _, _ = sample_batch(64, seed=0, split="heldout")
    written = [save_grid(images, directory / "shapes_heldout.png", n_cols=16)]
    try:
        from services.vae.evaluate import reconstruct_in_batches
        from services.vae.model import load_vae

        vae = load_vae()
        pairs = torch.cat([images[:16], reconstruct_in_batches(vae, images[:16])])
        written.append(save_grid(pairs, directory / "vae_reconstructions.png", n_cols=16))
        with torch.no_grad():
            prior = vae.sample(32, generator=torch.Generator().manual_seed(0))
        written.append(save_grid(prior, directory / "vae_prior_samples.png", n_cols=16))
    except FileNotFoundError as error:
        print(f"[VAE grids skipped: {error}]", file=sys.stderr)
    try:
        from services.gan.model import load_generator
        from services.gan.sampling import generate, sample_latents, slerp

        generator = load_generator()
        z_dim = generator.config.z_dim
        written.append(
            save_grid(generate(generator, sample_latents(64, 0, None, z_dim)), directory / "gan_samples.png")
        )
        rows = [generate(generator, sample_latents(16, 1, t, z_dim)) for t in (0.5, 1.0, None)]
        written.append(save_grid(torch.cat(rows), directory / "gan_truncation.png", n_cols=16))
        ends = sample_latents(8, 2, None, z_dim)
        steps = torch.linspace(0, 1, 10)
        path = torch.cat(
            [slerp(ends[2 * i].expand(10, z_dim), ends[2 * i + 1].expand(10, z_dim), steps) for i in range(4)]
        )
        written.append(save_grid(generate(generator, path), directory / "gan_slerp.png", n_cols=10))
    except FileNotFoundError as error:
        print(f"[GAN grids skipped: {error}]", file=sys.stderr)
    return written


def table(rows: list[Row]) -> str:
    lines = ["| metric | goal | measured | met |", "|---|---|---|---|"]
    return "\n".join(lines + [f"| {' | '.join(row)} |" for row in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 images/draws/prompts instead of 1,000/1,000/200")
    parser.add_argument("--skip-diffusion", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    parser.add_argument("--grids", type=Path, default=None, help="also write the docs' sample grids (PNG) here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n = 200 if args.quick else 1000
    rows = _guarded("dataset", dataset_rows, n) + _guarded("VAE", vae_rows, n) + _guarded("GAN", gan_rows, n)
    if args.skip_diffusion:
        rows += _missing("diffusion", "skipped (--skip-diffusion)")
    else:
        rows += _guarded("diffusion", diffusion_rows, 200)
    text = table(rows)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if args.grids is not None:
        for path in write_grids(args.grids):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
