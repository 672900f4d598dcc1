"""Image-model quality from the committed weights, as one markdown table of goal / measured / met.

    python -m bench.quality [--quick] [--skip-diffusion] [--negatives | --negatives-only] [--out docs/quality.md]
                            [--grids docs/img] [--threads 1] [--diffusion-weights DIR] [--negative-modes perp_neg:0.5]

Every number is read by the project's attribute reader (services/shapes/reader.py), on held-out data:
- dataset: the reader's own accuracy (all four attributes right) on 1,000 held-out dataset images;
- VAE: PSNR of reconstructions of 1,000 held-out images (and how often the reader still reads them right);
- GAN: over 1,000 seeded draws, the fraction read as one valid shape in a palette colour, and the fraction of the
  shape×colour combinations that appear among them (plain draws, and again with the truncation trick at 1.0);
- diffusion: ``genserve.services.diffusion.evaluate.evaluate(n_prompts=200, steps=20, guidance_scale=3.0, seed=0)``, the
  per-attribute prompt adherence over held-out prompts.
- negative prompts (``--negatives``, a second table; ``--negatives-only`` for just that one): per guidance mode, the
  adherence of the same 200 held-out prompts and seeds with no negative, with a negative naming another colour,
  shape or position, and with "a blurry image"; and the steering figure on colour-open prompts
  (``genserve.services.diffusion.negatives``).
A model whose weights (or code) are missing gets a row that says why instead of a crash. ``--quick`` uses 200
images / draws / prompts for a fast check (the goals are stated for the full counts). ``--grids DIR`` also
writes the sample grids the docs show (shapes_*, vae_*, gan_* PNGs), from the same weights and fixed seeds.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    # Run as a file: `bench` imports from the repository root, appended so that it never shadows an installed package.
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from genserve.services.shapes.dataset import sample_batch  # noqa: E402
from genserve.services.shapes.reader import accuracy, read_batch  # noqa: E402

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
    from genserve.services.vae.evaluate import evaluate
    from genserve.services.vae.model import load_vae

    metrics = evaluate(load_vae(), n_images=n, seed=0)
    return [
        _row(f"VAE: PSNR on {n} held-out images", metrics["psnr_db"], 28.0, " dB"),
        _row("VAE: reader accuracy on reconstructions, all attributes", metrics["recon_read_all"], None),
    ]


def gan_rows(n: int) -> list[Row]:
    from genserve.services.gan.evaluate import evaluate
    from genserve.services.gan.model import load_generator

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


def diffusion_rows(n: int, weights: Path | None = None) -> list[Row]:
    from genserve.services.diffusion.evaluate import evaluate
    from genserve.services.diffusion.pipeline import DiffusionPipeline

    scores = evaluate(n_prompts=n, steps=20, guidance_scale=3.0, seed=0, pipeline=DiffusionPipeline.from_dir(weights))
    goals = {"colour": 0.95, "shape": 0.85, "position": 0.80, "size": None, "all": None}
    where = f"{n} held-out prompts, 20 steps, guidance 3"
    return [_row(f"diffusion: {attr} correct ({where})", scores[attr], goal) for attr, goal in goals.items()]


# (guidance mode, negative weight) pairs the negative-prompt table compares; None: the model's default weight.
NEGATIVE_MODES: tuple[tuple[str, float | None], ...] = (("perp_neg", 0.3), ("cfg", None), ("perp_neg", 0.5),
                                                      ("perp_neg", 0.75), ("perp_neg", 1.0))
NEGATIVE_GOALS = {"colour": 0.95, "shape": 0.85, "position": 0.90}


def negative_tables(n: int, weights: Path | None = None,
                    modes: tuple[tuple[str, float | None], ...] = NEGATIVE_MODES) -> str:
    """The negative-prompt adherence table and the steering table, per mode in ``modes``, for the diffusion
    weights in ``weights`` (None: the committed ones). Without a negative every mode runs the same two passes, so
    that row and the steering baseline are computed once."""
    from genserve.services.diffusion.negatives import adherence, open_colour_reads, steering
    from genserve.services.diffusion.pipeline import DiffusionPipeline
    from genserve.services.vae.model import load_vae

    pipe, vae = DiffusionPipeline.from_dir(weights), load_vae()
    default = (pipe.model.default_guidance, pipe.model.default_negative_weight)
    adherence_lines = [f"| guidance | negatives ({n} held-out prompts, 20 steps, guidance 3) | colour | shape | "
                       "position | size | all | goals met (colour ≥ 0.95, shape ≥ 0.85, position ≥ 0.90) |",
                       "|---|---|---|---|---|---|---|---|"]
    steering_lines = [f"| guidance | drawn colour appears, no negative ({n} colour-open prompts) | with a negative "
                      "naming it | at most half as often | shape, size, position kept |", "|---|---|---|---|---|"]

    def add_adherence(name: str, negatives: str, scores: dict[str, float]) -> None:
        met = all(scores[attr] >= goal for attr, goal in NEGATIVE_GOALS.items())
        cells = " | ".join(f"{scores[a]:.3f}" for a in ("colour", "shape", "position", "size", "all"))
        adherence_lines.append(f"| {name} | {negatives} | {cells} | {'yes' if met else 'no'} |")
        print(adherence_lines[-1], file=sys.stderr, flush=True)

    add_adherence("every mode", "none", adherence(pipe, vae, "none", n_prompts=n))
    before = open_colour_reads(pipe, vae, n_prompts=n)
    for mode, weight in modes:
        w_n = default[1] if weight is None else weight
        name = mode if mode == "cfg" else f"{mode}, w_n = {w_n:g}"
        name += " (default)" if (mode, w_n) == default else ""
        options = {"guidance": mode, "negative_weight": w_n}
        for negatives in ("contrasting", "generic"):
            add_adherence(name, negatives, adherence(pipe, vae, negatives, n_prompts=n, **options))
        figures = steering(pipe, vae, before, **options)
        met = "yes" if figures["with"] <= figures["without"] / 2 else "no"
        steering_lines.append(f"| {name} | {figures['without']:.3f} | {figures['with']:.3f} | {met} | "
                              f"{figures['kept']:.3f} |")
        print(steering_lines[-1], file=sys.stderr, flush=True)
    return "\n".join(adherence_lines) + "\n\n" + "\n".join(steering_lines)


def _parse_modes(text: str) -> tuple[tuple[str, float | None], ...]:
    """'perp_neg:0.5,cfg' -> (("perp_neg", 0.5), ("cfg", None))."""
    modes = []
    for item in text.split(","):
        mode, _, weight = item.strip().partition(":")
        modes.append((mode, float(weight) if weight else None))
    return tuple(modes)


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
    from genserve.services.shapes.grid import save_grid

    images, _, _ = sample_batch(64, seed=0, split="heldout")
    written = [save_grid(images, directory / "shapes_heldout.png", n_cols=16)]
    try:
        from genserve.services.vae.evaluate import reconstruct_in_batches
        from genserve.services.vae.model import load_vae

        vae = load_vae()
        pairs = torch.cat([images[:16], reconstruct_in_batches(vae, images[:16])])
        written.append(save_grid(pairs, directory / "vae_reconstructions.png", n_cols=16))
        with torch.no_grad():
            prior = vae.sample(32, generator=torch.Generator().manual_seed(0))
        written.append(save_grid(prior, directory / "vae_prior_samples.png", n_cols=16))
    except FileNotFoundError as error:
        print(f"[VAE grids skipped: {error}]", file=sys.stderr)
    try:
        from genserve.services.gan.model import load_generator
        from genserve.services.gan.sampling import generate, sample_latents, slerp

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


def _print_and_write(text: str, out: Path | None) -> int:
    print(text)
    if out is not None:
        out.write_text(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 images/draws/prompts instead of 1,000/1,000/200")
    parser.add_argument("--skip-diffusion", action="store_true")
    parser.add_argument("--negatives", action="store_true", help="also the negative-prompt tables (200 prompts)")
    parser.add_argument("--negatives-only", action="store_true", help="only the negative-prompt tables")
    parser.add_argument("--negative-prompts", type=int, default=200, help="prompts per negative-prompt row")
    parser.add_argument("--negative-modes", default=None,
                        help="only these guidance modes in the negative-prompt tables, e.g. 'perp_neg:0.5,cfg' "
                             "(default: every mode of NEGATIVE_MODES)")
    parser.add_argument("--diffusion-weights", type=Path, default=None,
                        help="diffusion checkpoint directory for the diffusion rows and tables (default: committed)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    parser.add_argument("--grids", type=Path, default=None, help="also write the docs' sample grids (PNG) here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n = 200 if args.quick else 1000
    modes = NEGATIVE_MODES if args.negative_modes is None else _parse_modes(args.negative_modes)
    negatives = functools.partial(negative_tables, weights=args.diffusion_weights, modes=modes)
    if args.negatives_only:
        return _print_and_write(negatives(args.negative_prompts), args.out)
    rows = _guarded("dataset", dataset_rows, n) + _guarded("VAE", vae_rows, n) + _guarded("GAN", gan_rows, n)
    if args.skip_diffusion:
        rows += _missing("diffusion", "skipped (--skip-diffusion)")
    else:
        rows += _guarded("diffusion", functools.partial(diffusion_rows, weights=args.diffusion_weights), 200)
    text = table(rows) + (f"\n\n{negatives(args.negative_prompts)}" if args.negatives else "")
    _print_and_write(text, args.out)
    if args.grids is not None:
        for path in write_grids(args.grids):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
