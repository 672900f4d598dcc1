"""Multi-LoRA in the text engine (issue 33) against transformers + peft on tiny random checkpoints: a Llama and a
Qwen2 (q/k/v biases), each with three random PEFT adapters of different ranks and targets (lora_helpers.ADAPTERS).
Every adapter gives peft's greedy tokens alone and in one continuous batch that mixes all three and the base model:
on the CPU runner (prefill on torch through the hooks, decode on the fused C step with greedy lookahead), on the
torch path alone, and under GENSERVE_BACKEND=triton (the interpreter) with the LoRA kernel launches counted. Then the
registry's refusals, capacity and LRU, the prefix cache's adapter keys, and Phi-3's fused projections."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_helpers import ADAPTERS, peft_greedy, save_adapter
from safetensors.torch import save_file
from text_helpers import byte_tokenizer, hf_model, save_hf

from genserve.services.text.engine.adapters import LoraConfig
from genserve.services.text.engine.engine import EngineConfig, LLMEngine
from genserve.services.text.engine.params import (
    AdapterCapacityExceeded,
    AdapterNotFound,
    InvalidAdapter,
    SamplingParams,
)
from genserve.services.text.loader import load_model
from genserve.services.text.lora import load_adapter
from genserve.shared.blocks.backend import get_backend

PROMPT = list(b"The quick brown fox")
NEW_TOKENS = 8
MIXED = [*ADAPTERS, ""]  # every adapter and the base model, in one batch
# What does not depend on the architecture (the torch path, the interpreter, the registry) runs on the Llama only.
LLAMA_ONLY = pytest.mark.parametrize("case", ["llama"], indirect=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tmp_path_factory) -> dict:
    """A base checkpoint, its three adapters under one root, and peft's greedy tokens for each (and the base)."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = hf_model(request.param)
    model_dir = save_hf(base, root / "base", sharded=False)
    for i, (name, lora) in enumerate(ADAPTERS.items()):
        save_adapter(base, root / name, seed=i, **lora)
    expected = {name: peft_greedy(base, root / name if name else None, PROMPT, NEW_TOKENS) for name in MIXED}
    assert len({tuple(t) for t in expected.values()}) == len(MIXED)  # every adapter changes the greedy tokens
    return dict(root=root, model_dir=model_dir, expected=expected, arch=request.param)


def _engine(case: dict, backend: str | None = None, **lora) -> LLMEngine:
    model = load_model(case["model_dir"], backend=get_backend(backend) if backend else None)
    settings = dict(root=str(case["root"]), adapters=tuple((n, n) for n in ADAPTERS)) | lora
    return LLMEngine(model, byte_tokenizer(), EngineConfig(num_blocks=64, lora=LoraConfig(**settings)))


def _greedy(engine: LLMEngine, names: list[str], n: int = NEW_TOKENS) -> dict[str, list[int]]:
    out = engine.generate_batch([PROMPT] * len(names),
                                [SamplingParams(max_tokens=n, temperature=0, adapter=name) for name in names])
    return {name: tokens for name, (_, tokens, _) in zip(names, out, strict=True)}


def test_each_adapter_matches_peft_alone_and_in_one_mixed_batch_on_the_fused_cpu_step(case) -> None:
    engine = _engine(case)
    assert engine.runner.fused is not None and engine.adapters() == sorted(ADAPTERS)
    for name in MIXED:
        assert _greedy(engine, [name]) == {name: case["expected"][name]}, name
    assert _greedy(engine, MIXED) == case["expected"]


@LLAMA_ONLY
def test_the_torch_path_and_one_adapter_slot_give_the_same_tokens(case) -> None:
    # "reference" keeps the fused step off (every step on the model's forward with the LoRA hooks); one slot makes
    # the scheduler run the adapters' requests in turns, each writing its weights into the one slot.
    engine = _engine(case, "reference", max_loras=1)
    assert engine.runner.fused is None
    assert _greedy(engine, MIXED) == case["expected"]


@LLAMA_ONLY
def test_triton_interpreted_mixed_batch_matches_peft_with_the_kernels_counted(case, monkeypatch) -> None:
    from genserve.kernels import lora as kernels

    calls = {"shrink": 0, "expand": 0}
    for kind in calls:
        real = getattr(kernels, f"lora_{kind}")

        def counted(*args, real=real, kind=kind):
            calls[kind] += 1
            return real(*args)

        monkeypatch.setattr(kernels, f"lora_{kind}", counted)
    engine = _engine(case, "triton")
    assert engine.runner.name == "cuda"
    n = 2  # a prefill step and a decode step: the interpreter is slow
    assert _greedy(engine, MIXED, n) == {name: t[:n] for name, t in case["expected"].items()}
    projections = 7 * engine.model.config.n_layers
    assert calls == {"shrink": n * projections, "expand": n * projections}  # every step, every projection, once


@LLAMA_ONLY
def test_refusals_name_the_adapter_tensor_and_shape(case, tmp_path) -> None:
    root = case["root"]
    engine = _engine(case, max_lora_rank=4, adapters=())
    with pytest.raises(InvalidAdapter, match=r"r=8, the server takes ranks 1..4"):
        engine.load_adapter("big", "all8")
    with pytest.raises(InvalidAdapter, match="outside the adapter root"):
        engine.load_adapter("up", "../elsewhere")
    with pytest.raises(InvalidAdapter, match="outside the adapter root"):
        engine.load_adapter("abs", str(tmp_path))
    with pytest.raises(AdapterNotFound, match="'nope'"):
        engine.add_request("r1", PROMPT, SamplingParams(adapter="nope"), lambda d: None)
    with pytest.raises(AdapterNotFound, match="'nope'"):
        engine.unload_adapter("nope")
    # a base-model mismatch: qv4's config and tensors with q_proj's A one column short
    bad = root / "bad"
    bad.mkdir(exist_ok=True)
    (bad / "adapter_config.json").write_text((root / "qv4" / "adapter_config.json").read_text())
    from safetensors.torch import load_file

    tensors = load_file(root / "qv4" / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(InvalidAdapter, match=rf"{key} has shape \(4, 63\).*expected.*\(4, 64\)"):
        engine.load_adapter("bad", "bad")
    # a target the server does not adapt, and a corrupt file
    tensors = {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(InvalidAdapter, match="lm_head.lora_A.weight adapts nothing served"):
        engine.load_adapter("bad", "bad")
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InvalidAdapter, match="cannot read"):
        engine.load_adapter("bad", "bad")
    assert engine.adapters() == []


@LLAMA_ONLY
def test_capacity_lru_and_unload(case) -> None:
    engine = _engine(case, max_loras=1, max_cpu_loras=2, adapters=())
    engine.load_adapter("a", "qv4")
    engine.load_adapter("b", "ffn2")
    engine.add_request("r1", PROMPT, SamplingParams(max_tokens=2, adapter="a"), lambda d: None)
    engine.add_request("r2", PROMPT, SamplingParams(max_tokens=2, adapter="b"), lambda d: None)
    with pytest.raises(AdapterCapacityExceeded, match="'c'.*max_cpu_loras"):
        engine.load_adapter("c", "all8")  # both adapters in memory are held by queued requests
    while engine.has_work():
        engine.step()
    engine.load_adapter("c", "all8")  # evicts "a", the least recently used; its name stays loaded
    assert engine.adapters() == ["a", "b", "c"] and list(engine.registry._memory) == ["b", "c"]
    assert _greedy(engine, ["a"]) == {"a": case["expected"]["qv4"]}  # read again from its folder
    engine.unload_adapter("a")
    with pytest.raises(AdapterNotFound, match="'a'"):
        engine.add_request("r3", PROMPT, SamplingParams(adapter="a"), lambda d: None)


@LLAMA_ONLY
def test_prefix_cache_keys_include_the_adapter(case) -> None:
    engine = _engine(case)
    prompt = PROMPT * 3  # 57 tokens: three full blocks of 16
    for name in ("", "qv4", "qv4", "all8"):
        engine.generate_batch([prompt], SamplingParams(max_tokens=1, temperature=0, adapter=name))
    # only the second qv4 request found its blocks; the base model's blocks served neither adapter
    assert engine.counters().hit_tokens == 48
    assert _greedy(engine, ["qv4"]) == {"qv4": case["expected"]["qv4"]}


def test_phi3_fused_projections_split_into_their_parts(tmp_path: Path) -> None:
    """Phi-3 adapters target qkv_proj and gate_up_proj; A is shared, so each part's delta is its rows of B."""
    dim, nq, nkv, ffn, r = 8, 8, 4, 12, 2
    a_qkv, b_qkv = torch.randn(r, dim), torch.randn(nq + 2 * nkv, r)
    a_gu, b_gu = torch.randn(r, dim), torch.randn(2 * ffn, r)
    prefix = "base_model.model.model.layers.0"
    save_file({f"{prefix}.self_attn.qkv_proj.lora_A.weight": a_qkv, f"{prefix}.self_attn.qkv_proj.lora_B.weight": b_qkv,
               f"{prefix}.mlp.gate_up_proj.lora_A.weight": a_gu, f"{prefix}.mlp.gate_up_proj.lora_B.weight": b_gu},
              tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 4, "target_modules": ["qkv_proj", "gate_up_proj"]}))
    projections = {(0, "q_proj"): (dim, nq), (0, "k_proj"): (dim, nkv), (0, "v_proj"): (dim, nkv),
                   (0, "gate_proj"): (dim, ffn), (0, "up_proj"): (dim, ffn)}
    adapter = load_adapter("phi", tmp_path, projections, max_rank=4)
    assert adapter.scale == 2.0 and sorted(adapter.targets) == ["gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"]
    torch.testing.assert_close(adapter.weights[(0, "k_proj")][1], 2.0 * b_qkv[nq:nq + nkv])
    torch.testing.assert_close(adapter.weights[(0, "up_proj")][0], a_gu)
    torch.testing.assert_close(adapter.weights[(0, "up_proj")][1], 2.0 * b_gu[ffn:])


@LLAMA_ONLY
def test_genserve_generate_runs_one_adapter_in_process(case, capsys) -> None:
    import argparse

    from genserve.services.text import generate

    byte_tokenizer()._tok.save(str(case["model_dir"] / "tokenizer.json"))
    text = bytes(PROMPT).decode()
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args([text, "--model-dir", str(case["model_dir"]), "--lora", str(case["root"] / "all8"),
                              "--max-tokens", str(NEW_TOKENS), "--temperature", "0", "--json"])
    assert generate.run(args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == case["expected"]["all8"]
