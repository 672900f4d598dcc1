"""Time one 20-step DDIM image with classifier-free guidance on CPU: our U-Net pipeline vs diffusers.

Both sides run 20 denoiser calls per image on a batch of 2 (conditional + unconditional) at the same latent size,
guidance arithmetic and a DDIM step. Ours is the whole ``DiffusionPipeline.generate`` call, so it also tokenizes and
encodes the prompts; the diffusers loop gets its text features precomputed (a small head start for diffusers).
The diffusers side is a ``UNet2DConditionModel`` configured like ours (same channels, levels, attention placement,
cross-attention width and heads) driven by diffusers' ``DDIMScheduler``; diffusers is a bench/test-only dependency.
The two sides alternate image by image in one process, so load from other jobs on a shared machine falls on both.
Prints a table with parameter counts, the median and the best milliseconds per image, and the speed ratios.

With ``--model DIR`` (a Stable-Diffusion-format diffusers folder) it times, instead, the whole text-to-image call
on that folder: our ``DiffusionPipeline`` plus our AutoencoderKL decode against diffusers' ``StableDiffusionPipeline``
(``output_type="np"``), same prompt, seed, sampler (the folder's DDIM settings), steps and guidance, and prints how
far apart the two images are (they should agree within 2/255). A tiny SD-shaped folder to try it on:

    python -m tests.services.diffusion.tiny_sd /tmp/tiny-sd --latent 64
    python bench/diffusion.py --model /tmp/tiny-sd [--threads 2] [--repeats 3] [--steps 20]

    python bench/diffusion.py [--threads 1] [--repeats 5] [--weights services/diffusion/weights]

With ``--dit DIR`` (an SD3- or Flux-format folder) it times the DiT row: our pipeline plus our VAE decode against
diffusers' StableDiffusion3Pipeline / FluxPipeline at ``--size`` pixels (the folder's flow-match Euler, CFG for SD3,
the guidance embedding for Flux). ``--cache THRESHOLD`` adds the step-caching rows: our pipeline without and with
FirstBlockCache at that threshold, the steps it skipped, the speed ratio and the PSNR of the cached image against
the uncached one (services/diffusion/step_cache.py). A random SD3-shaped folder to try it on:

    python -m tests.services.diffusion.tiny_sd3 /tmp/sd3-bench --latent 64 --layers 4 --width 64
    python bench/diffusion.py --dit /tmp/sd3-bench --size 512 --steps 28 --repeats 2 [--cache 0.08]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from genserve.services.common.gc_freeze import freeze_loaded_objects
from genserve.services.diffusion.model import LatentDiffusion, default_config, load_diffusion
from genserve.services.diffusion.pipeline import DiffusionPipeline

PROMPT = "a large blue square at the bottom right"
SD_PROMPT = "An astronaut riding a horse, oil painting"


def diffusers_twin(model: LatentDiffusion) -> torch.nn.Module:
    """A diffusers UNet2DConditionModel with our U-Net's architecture (random weights)."""
    from diffusers import UNet2DConditionModel

    c = model.config.unet
    levels = range(len(c.block_out_channels))
    return UNet2DConditionModel(
        sample_size=model.config.latent_shape[1], in_channels=c.in_channels, out_channels=c.out_channels,
        block_out_channels=c.block_out_channels, layers_per_block=c.layers_per_block,
        down_block_types=tuple("CrossAttnDownBlock2D" if i in c.attention_levels else "DownBlock2D" for i in levels),
        up_block_types=tuple("CrossAttnUpBlock2D" if i in c.attention_levels else "UpBlock2D"
                             for i in reversed(levels)),
        cross_attention_dim=c.cross_attention_dim, norm_num_groups=c.norm_groups, use_linear_projection=True,
        # diffusers' "attention_head_dim" is the number of heads per level (a known naming trap).
        attention_head_dim=tuple(ch // c.head_dim for ch in c.block_out_channels),
    ).eval()


def image_ours(pipe: DiffusionPipeline, steps: int, guidance: float) -> Callable[[int], torch.Tensor]:
    return lambda seed: pipe.generate([PROMPT], steps=steps, guidance_scale=guidance, seed=seed)


def image_diffusers(unet: torch.nn.Module, pipe: DiffusionPipeline, steps: int,
                    guidance: float) -> Callable[[int], torch.Tensor]:
    from diffusers import DDIMScheduler

    s = pipe.model.schedule("ddim")
    scheduler = DDIMScheduler(num_train_timesteps=s.num_train_timesteps, beta_schedule=s.beta_schedule,
                              prediction_type=s.prediction_type, timestep_spacing=s.timestep_spacing,
                              clip_sample=False)
    with torch.inference_mode():
        context = pipe.encode_prompts([PROMPT, ""])

    @torch.inference_mode()
    def one_image(seed: int) -> torch.Tensor:
        latents = torch.randn((1, *pipe.latent_shape), generator=torch.Generator().manual_seed(seed)).to(pipe.device)
        scheduler.set_timesteps(steps)
        for t in scheduler.timesteps:
            out = unet(torch.cat([latents, latents]), t, encoder_hidden_states=context).sample
            cond, uncond = out.chunk(2)
            latents = scheduler.step(uncond + guidance * (cond - uncond), t, latents).prev_sample
        return latents

    return one_image


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_interleaved(ours: Callable[[int], torch.Tensor], theirs: Callable[[int], torch.Tensor],
                     repeats: int) -> tuple[list[float], list[float]]:
    """Seconds per image for each side. The two alternate image by image, and which goes first alternates too, so
    load from other jobs on a shared machine falls on both sides alike."""
    ours(0), theirs(0)  # warm-up
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for r in range(repeats):
        order = [("ours", ours), ("theirs", theirs)]
        for name, image in order if r % 2 == 0 else reversed(order):
            _sync()
            start = time.perf_counter()
            image(r)
            _sync()  # CUDA queues kernels: without it a side that returns device tensors is timed at its launches
            times[name].append(time.perf_counter() - start)
    return times["ours"], times["theirs"]


def sd_sides(folder: Path, steps: int, guidance: float) -> tuple[Callable, Callable, dict[str, int]]:
    """(ours, diffusers', parameter counts) for a Stable Diffusion folder; each side returns (N, H, W, 3) in [0, 1]."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    from genserve.shared.blocks.autoencoder_kl import load_autoencoder_kl

    ref = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None, requires_safety_checker=False)
    ref.scheduler = DDIMScheduler.from_config(ref.scheduler.config)
    ref.set_progress_bar_config(disable=True)
    pipe = DiffusionPipeline.from_dir(folder)
    vae = load_autoencoder_kl(folder / "vae")

    @torch.inference_mode()
    def ours(seed: int) -> torch.Tensor:
        latents = pipe.generate([SD_PROMPT], steps=steps, guidance_scale=guidance, seed=seed, scheduler="ddim")
        return ((vae.decode(latents).clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1)

    def theirs(seed: int) -> torch.Tensor:
        return torch.from_numpy(ref(SD_PROMPT, num_inference_steps=steps, guidance_scale=guidance, output_type="np",
                                    generator=torch.Generator("cpu").manual_seed(seed)).images)

    counts = {"unet": sum(p.numel() for p in pipe.model.unet.parameters()),
              "vae": sum(p.numel() for p in vae.parameters()),
              "text": sum(p.numel() for p in pipe.model.text_encoder.parameters())}
    return ours, theirs, counts


def main_sd(args: argparse.Namespace) -> None:
    ours, theirs, counts = sd_sides(args.model, args.steps, args.guidance_scale)
    diff = (ours(0) * 255).round().sub((theirs(0) * 255).round()).abs().max().item()
    ours_times, theirs_times = time_interleaved(ours, theirs, args.repeats)
    h, w = ours(0).shape[1:3]
    print(f"{args.model}: {args.steps}-step DDIM + guidance {args.guidance_scale}, {w}x{h} image, "
          f"{args.threads} thread(s), {args.repeats} interleaved images per side; U-Net {counts['unet'] / 1e6:.2f}M, "
          f"VAE {counts['vae'] / 1e6:.2f}M, text {counts['text'] / 1e6:.2f}M parameters")
    print(f"largest pixel difference between the two images for seed 0: {diff:.0f}/255")
    print("| pipeline | median ms / image | best ms / image | speed-up (median) | speed-up (best) |")
    print("|---|---|---|---|---|")
    for name, times in (("diffusers StableDiffusionPipeline", theirs_times), ("genserve DiffusionPipeline + VAE",
                                                                               ours_times)):
        median, best = statistics.median(times), min(times)
        print(f"| {name} | {median * 1e3:.1f} | {best * 1e3:.1f} | "
              f"{statistics.median(theirs_times) / median:.2f}x | {min(theirs_times) / best:.2f}x |")


def dit_sides(folder: Path, steps: int, guidance: float, size: int, cache: float | None = None
              ) -> tuple[Callable, Callable, DiffusionPipeline]:
    """(ours, diffusers', our pipeline) for an SD3- or Flux-format folder; each side returns (1, H, W, 3) in [0, 1].
    ``cache``: ours runs with FirstBlockCache at that threshold (the diffusers side is then ours uncached)."""
    import json

    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    from genserve.shared.blocks.autoencoder_kl_flow import load_flow_autoencoder_kl

    pipe = DiffusionPipeline.from_dir(folder)
    vae, _ = load_flow_autoencoder_kl(folder / "vae")

    def run(threshold: float | None) -> Callable[[int], torch.Tensor]:
        @torch.inference_mode()
        def image(seed: int) -> torch.Tensor:
            state = pipe.prepare([SD_PROMPT], steps=steps, guidance_scale=guidance, seed=seed, height=size,
                                 width=size, cache_threshold=threshold)
            while not state.done:
                pipe.step(state)
            image.skipped = getattr(state.context.step_cache, "skipped", 0)
            return ((vae.decode(state.unscaled()).clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1)
        return image

    if cache is not None:
        return run(cache), run(None), pipe
    cls = FluxPipeline if json.loads((folder / "model_index.json").read_text())["_class_name"] == "FluxPipeline" \
        else StableDiffusion3Pipeline
    ref = cls.from_pretrained(folder)
    ref.set_progress_bar_config(disable=True)

    def theirs(seed: int) -> torch.Tensor:
        return torch.from_numpy(ref(SD_PROMPT, num_inference_steps=steps, guidance_scale=guidance, height=size,
                                    width=size, output_type="np",
                                    generator=torch.Generator("cpu").manual_seed(seed)).images)

    return run(None), theirs, pipe


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two images in [0, 1] at 8 bits."""
    mse = (((a * 255).round() - (b * 255).round()) ** 2).mean().item()
    return float("inf") if mse == 0 else 10 * math.log10(255**2 / mse)


def main_dit(args: argparse.Namespace) -> None:
    ours, theirs, pipe = dit_sides(args.dit, args.steps, args.guidance_scale, args.size, args.cache)
    freeze_loaded_objects()  # as a replica does after start-up; both sides share the process and gain alike
    first_ours, first_theirs = ours(0), theirs(0)
    ours_times, theirs_times = time_interleaved(ours, theirs, args.repeats)
    params = sum(p.numel() for p in pipe.model.unet.parameters())
    print(f"{args.dit}: {args.steps}-step flow-match Euler, guidance {args.guidance_scale}, {args.size}x{args.size}, "
          f"{args.threads} thread(s), {args.repeats} interleaved images per side; transformer {params / 1e6:.2f}M")
    if args.cache is None:
        rows = (("diffusers", theirs_times), ("genserve DiffusionPipeline + VAE", ours_times))
        print(f"largest pixel difference for seed 0: {(first_ours - first_theirs).abs().max().item() * 255:.0f}/255")
    else:
        rows = (("genserve, no step cache", theirs_times), (f"genserve, FirstBlockCache {args.cache}", ours_times))
        print(f"steps skipped: {ours.skipped}/{args.steps}; PSNR of the cached image against the uncached one "
              f"(seed 0): {psnr(first_ours, first_theirs):.1f} dB")
    print("| pipeline | median ms / image | best ms / image | speed-up (median) | speed-up (best) |")
    print("|---|---|---|---|---|")
    for name, times in rows:
        median, best = statistics.median(times), min(times)
        print(f"| {name} | {median * 1e3:.1f} | {best * 1e3:.1f} | "
              f"{statistics.median(theirs_times) / median:.2f}x | {min(theirs_times) / best:.2f}x |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=Path, default=None, help="our checkpoint (default: random demo config)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a Stable Diffusion diffusers folder: time the whole pipeline against diffusers'")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance-scale", type=float, default=None, help="default 3.0, or 7.5 with --model")
    parser.add_argument("--dit", type=Path, default=None, help="an SD3- or Flux-format folder: the DiT rows")
    parser.add_argument("--size", type=int, default=512, help="--dit: image side in pixels")
    parser.add_argument("--cache", type=float, default=None, help="--dit: FirstBlockCache threshold rows")
    args = parser.parse_args(argv)
    if args.guidance_scale is None:
        args.guidance_scale = 7.5 if args.model is not None else 3.0
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model is not None:
        main_sd(args)
        return
    if args.dit is not None:
        main_dit(args)
        return
    model = load_diffusion(args.weights) if args.weights else LatentDiffusion(default_config()).eval()
    pipe = DiffusionPipeline(model)
    twin = diffusers_twin(model)

    ours_times, theirs_times = time_interleaved(image_ours(pipe, args.steps, args.guidance_scale),
                                                image_diffusers(twin, pipe, args.steps, args.guidance_scale),
                                                args.repeats)
    n_ours = sum(p.numel() for p in model.unet.parameters())
    n_theirs = sum(p.numel() for p in twin.parameters())
    shape = "x".join(str(d) for d in pipe.latent_shape)
    print(f"{args.steps}-step DDIM + guidance (batch 2 per step), latent {shape}, {args.threads} thread(s), "
          f"{args.repeats} interleaved images per side")
    print("| U-Net | parameters | median ms / image | best ms / image | speed-up (median) | speed-up (best) |")
    print("|---|---|---|---|---|---|")
    rows = [("diffusers UNet2DConditionModel", n_theirs, theirs_times),
            ("genserve genserve.shared.blocks.unet", n_ours, ours_times)]
    for name, n, times in rows:
        median, best = statistics.median(times), min(times)
        print(f"| {name} | {n / 1e6:.2f}M | {median * 1e3:.1f} | {best * 1e3:.1f} | "
              f"{statistics.median(theirs_times) / median:.2f}x | {min(theirs_times) / best:.2f}x |")


if __name__ == "__main__":
    main()
