"""The two model runners: chosen once from the device and backend, and the CUDA runner's math (Triton kernels for
every attention, norm and RoPE, padded decode batches, device sampling) checked without a GPU by forcing the Triton
backend on CPU tensors (TRITON_INTERPRET=1, tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from text_helpers import VOCAB, byte_tokenizer, hf_model, save_hf

from genserve import kernels
from genserve.services.text.engine.engine import EngineConfig, LLMEngine
from genserve.services.text.engine.params import SamplingParams
from genserve.services.text.loader import load_model
from genserve.services.text.runners.cpu import CpuRunner
from genserve.services.text.runners.cuda import CudaRunner
from genserve.shared.blocks.backend import get_backend

pytest.importorskip("triton", reason="triton is not installed on this platform")

ROOT = Path(__file__).resolve().parents[3]
CASES = {
    "llama": {},
    "mistral": {"sliding_window": 8},  # shorter than the prompts: windowed prefill, chunked prefill and decode
    "qwen2": {"tie_word_embeddings": True},
}
PROMPT = "the quick brown fox jumps over the lazy dog"  # 43 byte tokens
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    directory = save_hf(hf_model(request.param, **CASES[request.param]), tmp_path_factory.mktemp(request.param),
                        sharded=False)
    byte_tokenizer()._tok.save(str(directory / "tokenizer.json"))
    return directory


def _engine(directory: Path, backend: str, **config) -> LLMEngine:
    model = load_model(directory, backend=get_backend(backend))
    return LLMEngine(model, byte_tokenizer(), EngineConfig(**{"block_size": 16, "max_lookahead": 1, **config}))


def test_runner_is_chosen_from_the_device_and_backend(checkpoint) -> None:
    assert isinstance(_engine(checkpoint, "torch").runner, CpuRunner)
    assert isinstance(_engine(checkpoint, "auto").runner, CpuRunner)
    reference = _engine(checkpoint, "reference").runner
    assert isinstance(reference, CpuRunner) and reference.fused is None  # the written-out math stays written out
    triton = _engine(checkpoint, "triton")
    assert isinstance(triton.runner, CudaRunner) and triton.settings()["runner"] == "cuda"
    assert triton.settings()["max_lookahead"] == 1


def test_triton_runner_gives_the_torch_runners_greedy_tokens_with_paged_decode_on_the_kernel(checkpoint,
                                                                                            monkeypatch) -> None:
    calls = {"flash": 0, "paged": 0, "rms_norm": 0, "rope": 0}

    def counting(name: str, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    for name, attr in (("flash", "flash_attention"), ("paged", "paged_decode_attention"), ("rms_norm", "rms_norm"),
                       ("rope", "apply_rope")):
        monkeypatch.setattr(kernels, attr, counting(name, getattr(kernels, attr)))
    prompts = [list(PROMPT.encode()), list(b"sliding"), torch.randint(0, VOCAB, (30,)).tolist()]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    # A small token budget chunks the prefills and mixes them with decode steps.
    expected = _engine(checkpoint, "torch", max_batched_tokens=16).generate_batch(prompts, params)
    got = _engine(checkpoint, "triton", max_batched_tokens=16).generate_batch(prompts, params)
    assert [ids for _, ids, _ in got] == [ids for _, ids, _ in expected]
    layers = 2
    assert calls["paged"] >= layers * NEW_TOKENS  # every decode step, every layer, on the Triton kernel
    assert calls["flash"] >= layers * 3 and calls["rms_norm"] > 0 and calls["rope"] > 0


@pytest.mark.parametrize("checkpoint", ["llama"], indirect=True)  # the sampler is the same for every family
def test_triton_runner_samples_what_the_cpu_runner_samples(checkpoint) -> None:
    """Same seeds, same sampled tokens: the device sampler draws from each request's own generator."""
    prompts = [list(PROMPT.encode()), list(b"abc")]
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, seed=3),
              SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_k=20, seed=4, logprobs=2)]
    expected = _engine(checkpoint, "torch").generate_batch(prompts, params)
    got = _engine(checkpoint, "triton").generate_batch(prompts, params)
    assert [ids for _, ids, _ in got] == [ids for _, ids, _ in expected]


@pytest.mark.parametrize("checkpoint", ["llama"], indirect=True)  # each family's Triton tokens: the tests above
def test_genserve_generate_forced_to_triton_matches_torch(checkpoint) -> None:
    """`genserve generate` with GENSERVE_BACKEND=triton, in a fresh process, gives the torch engine's tokens."""
    env = {**os.environ, "GENSERVE_BACKEND": "triton", "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-P", "-m", "genserve.services.client.cli", "generate", "--model-dir", str(checkpoint),
         "--temperature", "0", "--max-tokens", str(NEW_TOKENS), "--json", PROMPT],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True)
    triton = json.loads(out.stdout)
    engine = _engine(checkpoint, "torch")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    ((_, expected, _),) = engine.generate_batch([byte_tokenizer().encode(PROMPT)], params)
    assert len(triton["token_ids"]) == NEW_TOKENS
    assert triton["token_ids"] == expected
