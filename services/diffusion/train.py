"""Train the latent text-to-image model (U-Net + text encoder, jointly) on the captioned shapes in VAE latent space.

``genserve train diffusion`` or ``python -m genserve.services.diffusion.train``. Seeded and resumable: the run directory
holds the latest raw weights, the EMA weights (``<run-dir>/ema``) and the optimizer state; running again with the same
``--run-dir`` continues from its step up to ``--steps`` (``--time-limit`` stops a chunk early, saving first).

Data: a pool of training-split images is rendered once per run, encoded by the frozen VAE to posterior (mean, std)
and multiplied by the VAE's ``scaling_factor``; each step draws a batch from the pool, samples z = μ + σ ε, a
timestep and noise, and regresses the U-Net onto the schedule's target (ε or v). ``--caption-dropout`` of the
captions are replaced by the empty prompt so the same network is also the unconditional model that classifier-free
guidance needs. ``--partial-captions`` of the others keep a random non-empty subset of their four attributes
("a green square", "a square at the bottom right"), so that a prompt or a negative prompt naming only some
attributes means something to the model; Perp-Neg's negative direction (issue 18) is only as good as the model's
reading of such partial captions. ``--unknown-words`` of the captions get one or two words outside the vocabulary
inserted (an empty caption becomes "a" and those words, like "a blurry image"), so that words the model cannot know
leave the image as it would be without them. Every ``--eval-every`` steps the EMA model is scored on held-out
prompts with the attribute reader (prompt adherence, which moves long after the loss flattens); every
``--sample-every`` steps a grid of fixed prompts lands in ``<run-dir>/samples/``. At the end the EMA weights are
exported (float16) to ``--out``. ``--init`` starts a fresh run directory from exported weights (e.g.
``services/diffusion/weights``) to fine-tune them, without the run directory they came from.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from genserve.services.common.weights import committed_weights
from genserve.services.diffusion.evaluate import evaluate, generate_images
from genserve.services.diffusion.model import (
    DEFAULT_WEIGHTS,
    DiffusionConfig,
    LatentDiffusion,
    default_config,
    save_diffusion,
)
from genserve.services.diffusion.pipeline import DiffusionPipeline
from genserve.services.diffusion.samples import DOC_PROMPTS
from genserve.services.diffusion.schedulers.schedule import add_noise, alphas_cumprod, training_target
from genserve.services.diffusion.tokenizer import WordTokenizer
from genserve.services.shapes.dataset import (
    CAPTION_ATTRIBUTES,
    attribute_subset,
    caption,
    partial_caption,
    sample_batch,
)
from genserve.services.shapes.grid import save_grid
from genserve.services.shapes.train_state import has_train_state, load_train_state, save_train_state
from genserve.shared.blocks.autoencoder import VAE, load_autoencoder
from genserve.shared.checkpoint import load_weights, read_extra


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", type=Path, default=Path("runs/diffusion"), help="checkpoints + optimizer state")
    parser.add_argument("--out", type=Path, default=DEFAULT_WEIGHTS, help="where the final EMA weights are exported")
    parser.add_argument("--vae", type=Path, default=committed_weights("vae"),
                        help="VAE weights (default services/vae/weights)")
    parser.add_argument("--steps", type=int, default=6000, help="total optimizer steps (a resumed run continues)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ema", type=float, default=0.998, help="EMA decay of the exported weights")
    parser.add_argument("--caption-dropout", type=float, default=0.15, help="fraction of captions made empty")
    parser.add_argument("--partial-captions", type=float, default=0.0,
                        help="fraction of the captions --caption-dropout leaves that keep only a random non-empty "
                             "subset of size, colour, shape and position (\"a green square\")")
    parser.add_argument("--unknown-words", type=float, default=0.0,
                        help="fraction of captions (full, partial or empty) given 1-2 out-of-vocabulary words, "
                             "so that unknown words are learned to mean nothing")
    parser.add_argument("--init", type=Path, default=None,
                        help="exported weights to start a fresh --run-dir from (fine-tuning); its model config wins "
                             "over --channels/--layers-per-block/--text-dim")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pool-size", type=int, default=40000, help="training images encoded once per run")
    parser.add_argument("--channels", type=str, default="64,128", help="U-Net block_out_channels")
    parser.add_argument("--layers-per-block", type=int, default=1)
    parser.add_argument("--text-dim", type=int, default=64)
    parser.add_argument("--sample-every", type=int, default=500)
    parser.add_argument("--save-every", type=int, default=250)
    parser.add_argument("--eval-every", type=int, default=1000, help="adherence check on held-out prompts")
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--final-eval-prompts", type=int, default=200)
    parser.add_argument("--time-limit", type=float, default=0.0, help="minutes; stop (and save) after this, 0 = none")
    parser.add_argument("--adopt-vae", action="store_true",
                        help="resume a run on a different (e.g. further-trained) VAE: take its scaling factor and "
                             "refit the preview map")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--no-progress", action="store_true", help="disable the tqdm progress bar")


def learning_rate(step: int, total: int, peak: float, warmup: int = 200) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def ema_update(ema: LatentDiffusion, model: LatentDiffusion, decay: float, step: int) -> None:
    """θ_ema ← d θ_ema + (1 − d) θ with d warmed up as min(decay, (1 + step) / (10 + step))."""
    d = min(decay, (1 + step) / (10 + step))
    for e, p in zip(ema.parameters(), model.parameters(), strict=True):
        e.lerp_(p, 1.0 - d)


@torch.no_grad()
def encode_pool(vae: VAE, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, str]],
                                                       torch.Tensor]:
    """(means, stds, attributes, images at 8×8) of ``n`` training images; latents in the VAE's un-scaled space."""
    images, _, attrs = sample_batch(n, seed=seed, split="train")
    means, stds = [], []
    for chunk in images.split(500):
        mean, logvar = vae.encode(chunk)
        means.append(mean)
        stds.append(torch.exp(0.5 * logvar))
    return torch.cat(means), torch.cat(stds), attrs, F.avg_pool2d(images, 4)


@torch.no_grad()
def fit_preview(model: LatentDiffusion, latents: torch.Tensor, small_images: torch.Tensor) -> None:
    """Least-squares 1×1 map latent (C) -> RGB from latents (N, C, h, w) to the images average-pooled to h×w."""
    x = latents.permute(0, 2, 3, 1).reshape(-1, latents.shape[1])  # (N h w, C)
    y = small_images.permute(0, 2, 3, 1).reshape(-1, 3)  # (N h w, 3)
    x1 = torch.cat([x, torch.ones(len(x), 1)], dim=1)
    solution = torch.linalg.lstsq(x1, y).solution  # (C + 1, 3)
    model.preview.weight.copy_(solution[:-1].T[:, :, None, None])
    model.preview.bias.copy_(solution[-1])


def build(args: argparse.Namespace, scaling_factor: float) -> tuple[LatentDiffusion, LatentDiffusion,
                                                                     torch.optim.Optimizer, dict]:
    """Fresh model, EMA copy, optimizer and counters, or all four restored from ``args.run_dir``."""
    if has_train_state(args.run_dir):
        config = DiffusionConfig.from_dict(read_extra(args.run_dir))
        model, ema = LatentDiffusion(config), LatentDiffusion(config)
        load_weights(args.run_dir, model)
        load_weights(args.run_dir / "ema", ema)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        counters = load_train_state(args.run_dir, {"adamw": optimizer})
        return model, ema, optimizer, counters
    torch.manual_seed(args.seed)
    counters = {"step": 0, "images_seen": 0, "train_seconds": 0.0, "evals": []}
    if args.init is not None:
        extra = read_extra(args.init)
        model = load_weights(args.init, LatentDiffusion(DiffusionConfig.from_dict(extra)))  # float16 -> float32
        counters["init"] = {"weights": str(args.init), "train": {k: v for k, v in extra.get("train", {}).items()
                                                                 if k != "evals"}}
    else:
        channels = tuple(int(c) for c in args.channels.split(","))
        model = LatentDiffusion(default_config(scaling_factor, channels, args.text_dim, args.layers_per_block))
    ema = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    return model, ema, optimizer, counters


def training_captions(attrs: list[dict[str, str]], partial: float, generator: torch.Generator) -> list[str]:
    """The caption of each of ``attrs``; with probability ``partial`` only a uniformly random non-empty subset of
    its attributes is named (``partial_caption``). Draws nothing from ``generator`` when ``partial`` is 0."""
    if partial <= 0:
        return [partial_caption(a) for a in attrs]
    keep = torch.rand(len(attrs), generator=generator) < partial
    masks = torch.randint(1, 2 ** len(CAPTION_ATTRIBUTES), (len(attrs),), generator=generator)
    return [partial_caption(attribute_subset(a, int(m)) if k else a) for a, k, m in zip(attrs, keep, masks,
                                                                                          strict=True)]


def insert_unknown_words(ids: torch.Tensor, tokenizer: WordTokenizer, probability: float,
                         generator: torch.Generator) -> torch.Tensor:
    """With ``probability`` per row, one or two ``<unk>`` ids inserted at random places after ``<bos>`` (the rest
    shifted right and cut at the fixed length); an empty caption becomes "a" and the unknown words."""
    out = ids.clone()
    chosen = torch.rand(len(ids), generator=generator) < probability
    counts = torch.randint(1, 3, (len(ids),), generator=generator)
    places = torch.rand(len(ids), 2, generator=generator)
    a_id = tokenizer.vocabulary.index("a")
    for row in chosen.nonzero().flatten().tolist():
        words = [i for i in ids[row, 1:].tolist() if i != tokenizer.pad_id] or [a_id]
        for place in places[row, : int(counts[row])].tolist():
            at = 1 + int(place * len(words))  # after the first word, so an article stays first
            words.insert(min(at, len(words)), tokenizer.unk_id)
        words = [tokenizer.bos_id, *words][: tokenizer.max_length]
        out[row] = torch.tensor(words + [tokenizer.pad_id] * (tokenizer.max_length - len(words)))
    return out


def save_run(args: argparse.Namespace, model: LatentDiffusion, ema: LatentDiffusion,
             optimizer: torch.optim.Optimizer, counters: dict) -> None:
    save_diffusion(args.run_dir, model, extra={"train": counters})
    save_diffusion(args.run_dir / "ema", ema, extra={"train": counters})
    save_train_state(args.run_dir, {"adamw": optimizer}, counters)


def sample_grid(ema: LatentDiffusion, vae: VAE, path: Path) -> None:
    """Two rows: the fixed prompts with guidance 3, then the same seeds without guidance (w = 1)."""
    pipe = DiffusionPipeline(ema)
    prompts = list(DOC_PROMPTS)
    guided = generate_images(pipe, vae, prompts, steps=20, guidance_scale=3.0, seed=0, scheduler="ddim")
    plain = generate_images(pipe, vae, prompts, steps=20, guidance_scale=1.0, seed=0, scheduler="ddim")
    save_grid(torch.cat([guided, plain]), path, n_cols=len(prompts))


def training_loss(model: LatentDiffusion, config: DiffusionConfig, abar: torch.Tensor, z: torch.Tensor,
                  ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """MSE between the U-Net output at (x_t, t, text) and the schedule's target (ε or v)."""
    noise = torch.randn(z.shape, generator=generator)
    t = torch.randint(0, config.schedule.num_train_timesteps, (z.shape[0],), generator=generator)
    x_t = add_noise(abar, z, noise, t)
    target = training_target(config.schedule, abar, z, noise, t)
    return F.mse_loss(model.unet(x_t, t, model.text_encoder(ids)), target)


def run(args: argparse.Namespace) -> dict:
    """Train (or resume) to ``args.steps``, export the EMA weights, return the final held-out adherence."""
    torch.set_num_threads(args.threads)
    vae = load_autoencoder(args.vae)
    for p in vae.parameters():
        p.requires_grad_(False)
    model, ema, optimizer, counters = build(args, vae.scaling_factor)
    new_vae = abs(model.config.scaling_factor - vae.scaling_factor) > 1e-6
    if new_vae and not args.adopt_vae:
        raise ValueError(f"run {args.run_dir} was started with scaling_factor {model.config.scaling_factor}, "
                         f"the VAE has {vae.scaling_factor}: pass --adopt-vae or use a fresh --run-dir")
    if new_vae:
        model.config = ema.config = dataclasses.replace(model.config, scaling_factor=vae.scaling_factor)
        counters.setdefault("vae_switches", []).append({"step": counters["step"], "scaling_factor": vae.scaling_factor})
    config = model.config
    means, stds, attrs, small = encode_pool(vae, args.pool_size, seed=args.seed)
    if (counters["step"] == 0 and args.init is None) or new_vae:
        fit_preview(model, means[:4000], small[:4000])
        ema.preview.load_state_dict(model.preview.state_dict())
    print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "pool": len(attrs),
                      "scaled_latent_std": round(float((means * config.scaling_factor).std()), 3)}))
    tokenizer = model.tokenizer()
    pool_ids = tokenizer([caption(a) for a in attrs])
    empty_ids = tokenizer([""])[0]
    abar = alphas_cumprod(config.schedule)

    model.train()
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + counters["step"])
    started, budget, seconds_before = time.monotonic(), args.time_limit * 60, counters["train_seconds"]
    first = counters["step"]
    bar = tqdm(range(first, args.steps), initial=first, total=args.steps, disable=args.no_progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr)
        index = torch.randint(0, len(attrs), (args.batch_size,), generator=gen)
        z = (means[index] + stds[index] * torch.randn(means[index].shape, generator=gen)) * config.scaling_factor
        ids = pool_ids[index].clone()
        ids[torch.rand(args.batch_size, generator=gen) < args.caption_dropout] = empty_ids
        if args.partial_captions > 0:  # drawn after the dropout, so runs without it keep their random stream
            dropped = (ids == empty_ids).all(dim=1)
            partial = tokenizer(training_captions([attrs[i] for i in index.tolist()], args.partial_captions, gen))
            ids = torch.where(dropped[:, None], ids, partial)
        if args.unknown_words > 0:
            ids = insert_unknown_words(ids, tokenizer, args.unknown_words, gen)
        loss = training_loss(model, config, abar, z, ids, gen)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        ema_update(ema, model, args.ema, step)
        bar.set_postfix(loss=f"{loss.item():.4f}")
        counters.update(step=step + 1, images_seen=counters["images_seen"] + args.batch_size,
                        train_seconds=round(seconds_before + time.monotonic() - started, 1))
        if (step + 1) % args.sample_every == 0:
            sample_grid(ema.eval(), vae, args.run_dir / "samples" / f"step_{step + 1:06d}.png")
        if (step + 1) % args.eval_every == 0:
            scores = evaluate(args.eval_prompts, pipeline=DiffusionPipeline(ema.eval()), vae=vae, seed=1)
            counters["evals"].append({"step": step + 1, **{k: round(scores[k], 3) for k in
                                                           ("colour", "shape", "size", "position", "all")}})
            tqdm.write(json.dumps(counters["evals"][-1]))
        out_of_time = budget > 0 and time.monotonic() - started > budget
        if (step + 1) % args.save_every == 0 or out_of_time:
            save_run(args, model, ema, optimizer, counters)
        if out_of_time:
            break
    save_run(args, model, ema, optimizer, counters)
    return export(args, ema.eval(), vae, counters)


def export(args: argparse.Namespace, ema: LatentDiffusion, vae: VAE, counters: dict) -> dict:
    """Score the EMA model on held-out prompts and write it, as float16, to ``args.out``."""
    metrics = evaluate(args.final_eval_prompts, pipeline=DiffusionPipeline(ema), vae=vae, seed=0)
    half = copy.deepcopy(ema).half()
    save_diffusion(args.out, half, extra={"train": counters, "metrics": metrics, "weights_dtype": "float16"})
    print(json.dumps({"step": counters["step"], **metrics}))
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="genserve train diffusion", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
