"""Every RPC of the four services over real gRPC through the Serve proxy, including both streams and the
diffusion -> VAE hop."""

from __future__ import annotations

import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

from genserve.services.client import Client
from genserve.services.client.requests import tensor_values
from genserve.services.common.deploy_config import LOCAL_TEXT_SETTINGS
from genserve.services.common.weights import committed_weights
from genserve.services.diffusion.model import DEMO_NEGATIVE_WEIGHT
from genserve.services.text.engine.kv_cache import block_bytes
from genserve.services.text.loader import load_model
from genserve.v1 import common_pb2

DEMO_TEXT_MODEL = committed_weights("text")

pytestmark = pytest.mark.e2e


def pixels(image: common_pb2.Image) -> np.ndarray:
    with Image.open(io.BytesIO(image.png)) as img:
        array = np.asarray(img.convert("RGB"), dtype=np.int16)
    assert array.shape == (image.height, image.width, 3)
    return array


def test_generate_greedy_is_deterministic_and_counts_tokens(client: Client) -> None:
    first = client.generate("The with statement", max_tokens=8, temperature=0)
    second = client.generate("The with statement", max_tokens=8, temperature=0)
    assert first.text == second.text and list(first.token_ids) == list(second.token_ids)
    assert 1 <= len(first.token_ids) <= 8
    assert first.finish_reason in ("length", "eos", "stop")
    assert first.prompt_tokens == len(client.tokenize("The with statement").token_ids)


def test_generate_same_seed_same_text(client: Client) -> None:
    a = client.generate("def main", max_tokens=8, temperature=1.0, seed=1234)
    b = client.generate("def main", max_tokens=8, temperature=1.0, seed=1234)
    assert list(a.token_ids) == list(b.token_ids)
    assert b.text == a.text and a.seed == 1234
    drawn = client.generate("def main", max_tokens=8, temperature=1.0)
    again = client.generate("def main", max_tokens=8, temperature=1.0, seed=drawn.seed)
    assert list(again.token_ids) == list(drawn.token_ids)


def test_generate_stream_arrives_incrementally_and_matches_unary(client: Client) -> None:
    unary = client.generate("Return the", max_tokens=16, temperature=0)
    start = time.perf_counter()
    arrivals, chunks = [], []
    for chunk in client.generate_stream("Return the", max_tokens=16, temperature=0):
        arrivals.append(time.perf_counter() - start)
        chunks.append(chunk)
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert chunks[-1].finish_reason == unary.finish_reason
    assert all(c.finish_reason == "" for c in chunks[:-1])
    # Streamed, not buffered: several chunks, and most arrive separated in time (a buffered reply would land
    # all at once, microseconds apart).
    assert len(chunks) >= 3
    gaps = np.diff(arrivals)
    assert (gaps > 1e-3).sum() >= len(gaps) // 2, f"chunks arrived in a burst: {arrivals}"


def test_tokenize_round_trips(client: Client) -> None:
    reply = client.tokenize("with open(path) as f:")
    assert len(reply.token_ids) == len(reply.tokens) > 0
    assert "open" in "".join(reply.tokens)


def test_chat_messages_use_the_template(client: Client) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    chat = client.tokenize(messages=messages)
    plain = client.tokenize("Say hi")
    assert len(chat.token_ids) > len(plain.token_ids)
    reply = client.generate(messages=messages, max_tokens=4, temperature=0)
    assert reply.prompt_tokens == len(chat.token_ids)


def test_model_info_reports_the_served_checkpoint_and_the_settings_that_took_effect(client: Client) -> None:
    """The stack serves the committed demo model (services/text/weights/config.json) with the CPU serve config's
    text settings (deploy_config.LOCAL_TEXT_SETTINGS)."""
    info = client.model_info()
    config = json.loads((DEMO_TEXT_MODEL / "config.json").read_text())
    assert (info.architecture, info.vocab_size, info.max_context) == ("LlamaForCausalLM", 4096, 1024)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (4096, 1024)
    assert info.n_params == load_model(DEMO_TEXT_MODEL, "float32").num_params()
    assert (info.dtype, info.runner, info.device, info.model_path) == ("float32", "cpu", "cpu", str(DEMO_TEXT_MODEL))
    settings = dict(LOCAL_TEXT_SETTINGS)
    assert (info.max_batched_tokens, info.max_running, info.max_lookahead, info.prefix_caching) == (
        settings["max_batched_tokens"], settings["max_running"], settings["max_lookahead"], settings["prefix_caching"])
    per_block = block_bytes(info.block_size, config["num_hidden_layers"], config["num_key_value_heads"],
                            config["head_dim"], torch.float32)
    assert info.kv_cache_bytes == info.kv_blocks_total * per_block > 0
    assert 0 < info.kv_blocks_free <= info.kv_blocks_total


def test_gan_sample_is_seeded(client: Client) -> None:
    a = client.gan_sample(2, seed=7)
    b = client.gan_sample(2, seed=7)
    assert len(a.images) == 2 and a.seed == 7
    assert [i.png for i in a.images] == [i.png for i in b.images]
    assert (a.images[0].width, a.images[0].height) == (32, 32)
    assert client.gan_sample(1).seed >= 0


def test_gan_interpolate_ends_at_the_two_seeds(client: Client) -> None:
    path = client.gan_interpolate(3, 11, steps=4)
    assert len(path.images) == 4
    start, end = client.gan_sample(1, seed=3).images[0], client.gan_sample(1, seed=11).images[0]
    assert np.abs(pixels(path.images[0]) - pixels(start)).max() <= 1
    assert np.abs(pixels(path.images[-1]) - pixels(end)).max() <= 1


def test_vae_encode_decode_equals_reconstruct(client: Client) -> None:
    pngs = [image.png for image in client.gan_sample(2, seed=5).images]
    encoded = client.vae_encode(pngs)
    assert list(encoded.latents.shape) == [2, 4, 8, 8]
    assert encoded.latents.dtype == "float32" and len(encoded.latents.data) == 2 * 4 * 8 * 8 * 4
    assert encoded.latents.data == encoded.mean.data
    assert list(encoded.logvar.shape) == [2, 4, 8, 8] and encoded.scaling_factor > 0
    decoded = client.vae_decode(encoded.latents.shape, tensor_values(encoded.latents))
    reconstructed = client.vae_reconstruct(pngs)
    for d, r in zip(decoded.images, reconstructed.images, strict=True):
        assert np.abs(pixels(d) - pixels(r)).max() <= 1
    sampled = client.vae_encode(pngs, sample=True, seed=3)
    assert sampled.latents.data != sampled.mean.data
    assert client.vae_encode(pngs, sample=True, seed=3).latents.data == sampled.latents.data


def test_diffusion_generate_goes_through_the_vae(client: Client) -> None:
    a = client.diffuse("a large red circle at the top left", steps=2, seed=4, num_images=2)
    b = client.diffuse("a large red circle at the top left", steps=2, seed=4, num_images=2)
    assert len(a.images) == 2 and a.seed == 4
    assert (a.images[0].width, a.images[0].height) == (32, 32)
    assert [i.png for i in a.images] == [i.png for i in b.images]


def test_diffusion_guidance_mode_is_the_requests_and_perp_neg_by_default(client: Client) -> None:
    request = {"negative_prompt": "a green square", "steps": 3, "seed": 5}
    prompt = "a large yellow square at the top left"
    pngs = {mode: client.diffuse(prompt, guidance=mode, **request).images[0].png for mode in ("", "cfg", "perp_neg")}
    assert pngs[""] == pngs["perp_neg"] != pngs["cfg"]
    weighted = client.diffuse(prompt, guidance="perp_neg", negative_weight=DEMO_NEGATIVE_WEIGHT, **request)
    assert weighted.images[0].png == pngs["perp_neg"]


def test_diffusion_stream_reports_every_step_then_the_images(client: Client) -> None:
    events = list(client.diffuse_stream("a small blue square", steps=3, seed=4, preview_every=2))
    progress = [e.progress.step for e in events if e.HasField("progress")]
    previews = [e.preview for e in events if e.HasField("preview")]
    assert progress == [0, 1, 2, 3]  # 0: the request joined the step loop
    assert [p.step for p in previews] == [2] and len(previews[0].images) == 1
    assert events[-1].HasField("result") and sum(e.HasField("result") for e in events) == 1
    unary = client.diffuse("a small blue square", steps=3, seed=4)
    assert events[-1].result.images[0].png == unary.images[0].png


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)


def test_concurrent_diffusion_streams_share_the_loop_and_match_each_alone(client: Client) -> None:
    """Requests with their own scheduler, steps, guidance and negative, sent at once, share the replica's step loop
    (services/diffusion/step_batcher.py): each stream reports its own steps, and its image is within 1/255 per pixel
    of the same request sent alone."""
    requests = [
        {"prompt": "a large red circle", "steps": 6, "scheduler": "ddim", "guidance_scale": 3.0, "seed": 1},
        {"prompt": "a small blue square", "steps": 3, "scheduler": "dpmpp_2m", "guidance_scale": 5.0, "seed": 2,
         "negative_prompt": "a green square", "guidance": "cfg"},
        {"prompt": "a yellow cross", "steps": 4, "scheduler": "euler", "guidance_scale": 1.0, "seed": 3},
    ]

    def stream(request: dict) -> list:
        return list(client.diffuse_stream(**request))

    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(stream, requests))
    for request, events in zip(requests, together, strict=True):
        assert [e.progress.step for e in events if e.HasField("progress")] == list(range(0, request["steps"] + 1))
        alone = client.diffuse(**request).images[0].png
        diff = np.abs(_pixels(events[-1].result.images[0].png) - _pixels(alone)).max()
        assert diff <= 1, (request, diff)


def test_status_lists_every_app_running(client: Client) -> None:
    apps = {app.name: app for app in client.status().apps}
    assert set(apps) == {"text", "gan", "vae", "diffusion", "health", "http"}
    assert all(app.status == "RUNNING" and app.replicas.get("RUNNING", 0) >= 1 for app in apps.values())


def test_a_cancelled_stream_returns_its_kv_blocks(client: Client) -> None:
    info = client.model_info()
    stream = client.generate_stream("The with statement", max_tokens=min(1024, info.max_context - 16), seed=3)
    next(stream)
    assert client.model_info().kv_blocks_free < info.kv_blocks_total  # the sequence holds blocks while it runs
    stream.close()  # cancels the call; the replica aborts the request in the engine
    deadline = time.monotonic() + 10
    while client.model_info().kv_blocks_free != info.kv_blocks_total and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.model_info().kv_blocks_free == info.kv_blocks_total
