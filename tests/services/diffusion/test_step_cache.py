"""FirstBlockCache on the diffusion transformers: a threshold no step passes runs every block (the same latents as
no cache); a loose one skips the later steps' remaining blocks, counts them, and stays close to the uncached image;
a cached request gets denoiser calls of its own in the step batcher; a U-Net model refuses the field by name."""

from __future__ import annotations

import pytest
import torch

from genserve.services.diffusion.pipeline import DiffusionPipeline
from genserve.services.diffusion.step_batcher import StepBatcher
from genserve.services.diffusion.step_cache import FirstBlockCache
from tests.services.diffusion.tiny_flux import build_tiny_flux
from tests.services.diffusion.tiny_sd3 import build_tiny_sd3

PROMPT = "a red circle"


@pytest.fixture(scope="module")
def pipes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DiffusionPipeline]:
    root = tmp_path_factory.mktemp("cache")
    return {"sd3": DiffusionPipeline.from_dir(build_tiny_sd3(root / "sd3", latent=8, layers=3)),
            "flux": DiffusionPipeline.from_dir(build_tiny_flux(root / "flux", latent=8, layers=2))}


def _run(pipe: DiffusionPipeline, threshold: float | None, steps: int = 8):
    state = pipe.prepare([PROMPT], steps=steps, guidance_scale=4.0, seed=1, height=32, width=48,
                         cache_threshold=threshold)
    while not state.done:
        pipe.step(state)
    return state.unscaled(), state.context.step_cache


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_cache_skips_steps_and_stays_close(pipes, kind: str) -> None:
    pipe = pipes[kind]
    base, _ = _run(pipe, None)
    strict, cache = _run(pipe, 1e-9)
    assert cache.skipped == 0 and cache.steps == 8
    torch.testing.assert_close(strict, base, rtol=0, atol=1e-6)
    loose, cache = _run(pipe, 1.0)
    assert 0 < cache.skipped < cache.steps == 8  # the first step always runs in full
    psnr = 10 * torch.log10((base.max() - base.min()) ** 2 / ((loose - base) ** 2).mean())
    assert 15 < psnr < 200  # changed (steps were skipped), but the same image


def test_a_cached_request_runs_in_calls_of_its_own(pipes) -> None:
    pipe = pipes["sd3"]
    calls: list[int] = []
    batcher = StepBatcher(pipe.model.unet, max_rows=16, wait_s=0.2,
                          on_batch=lambda images, waits: calls.append(images))
    cached = pipe.prepare([PROMPT], steps=3, guidance_scale=4.0, seed=1, height=32, width=48, cache_threshold=0.5)
    plain = pipe.prepare([PROMPT], steps=3, guidance_scale=4.0, seed=1, height=32, width=48)
    futures = [batcher.submit(cached), batcher.submit(plain)]
    out = [f.result(timeout=120) for f in futures]
    batcher.close()
    assert calls == [1] * 6  # two requests, three steps, never in one call
    torch.testing.assert_close(out[1], _run(pipe, None, steps=3)[0], rtol=0, atol=1e-5)


def test_threshold_is_checked_and_unet_models_refuse_it(tiny_pipe) -> None:
    with pytest.raises(ValueError, match="cache_threshold must be in"):
        FirstBlockCache(0.0)
    with pytest.raises(ValueError, match="^cache_threshold: step caching runs on diffusion transformers"):
        tiny_pipe.generate(["a red circle"], steps=2, cache_threshold=0.1)


def test_dit_requests_batch_step_by_step_and_stay_batch_invariant(pipes) -> None:
    """Two Flux requests (different prompts, guidance, sizes alike) share each transformer call, and each image is
    the one it gets alone (well within 1/255 of the latents' range)."""
    pipe = pipes["flux"]
    calls: list[int] = []
    batcher = StepBatcher(pipe.model.unet, max_rows=16, wait_s=0.2,
                          on_batch=lambda images, waits: calls.append(images))
    settings = [("a red circle", 3.5, 1), ("a blue square", 1.5, 2)]
    states = [pipe.prepare([p], steps=3, guidance_scale=g, seed=s, height=32, width=48) for p, g, s in settings]
    together = [f.result(timeout=120) for f in [batcher.submit(state) for state in states]]
    batcher.close()
    assert calls == [2, 2, 2]
    for (p, g, s), latents in zip(settings, together, strict=True):
        alone = pipe.generate([p], steps=3, guidance_scale=g, seed=s, height=32, width=48)
        torch.testing.assert_close(latents, alone, rtol=0, atol=1e-4)
