"""The committed demo model, the offline ``generate`` CLI and the ``train text`` command."""

from __future__ import annotations

import argparse
import json

import pytest

from genserve.services.text import generate, train
from genserve.services.text.engine.async_engine import DEMO_DIR, AsyncLLMEngine
from genserve.services.text.engine.params import PromptTooLong, SamplingParams


def parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def demo() -> AsyncLLMEngine:
    engine = AsyncLLMEngine.from_dir()
    yield engine
    engine.shutdown()


def test_demo_model_info_and_limits(demo):
    info = demo.info()
    assert info["architecture"] == "LlamaForCausalLM" and info["dtype"] == "float32"
    assert 1_000_000 < info["n_params"] < 10_000_000
    assert info["kv_blocks_free"] == info["kv_blocks_total"] > 0
    assert info["max_context"] == demo.max_context == 1024
    assert sum(p.stat().st_size for p in DEMO_DIR.iterdir()) < 15 * 2**20
    with pytest.raises(PromptTooLong):
        demo.generate([1] * 1000, SamplingParams(max_tokens=100))


def test_demo_model_continues_python_prose(demo):
    prompt = demo.tokenizer.encode("The with statement")
    text, ids, reason = demo.generate(prompt, SamplingParams(max_tokens=24, temperature=0))
    assert reason == "length" and len(ids) == 24
    assert demo.tokenizer.decode(ids) == text
    words = text.split()
    assert len(words) >= 8 and sum(w.isascii() for w in words) == len(words)
    chat = demo.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "User: hi\n\nAssistant:"


def test_generate_cli_prints_json(capsys):
    args = parse(generate, ["--json", "--max-tokens", "5", "--temperature", "0", "--seed", "1", "--model-dir",
                            str(DEMO_DIR), "def"])
    assert generate.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "finish_reason"}
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"


def test_generate_cli_rejects_bad_options(capsys):
    assert generate.run(parse(generate, ["--temperature", "-1", "x"])) == 2
    assert "temperature" in capsys.readouterr().err


def test_train_text_writes_a_loadable_checkpoint(tmp_path):
    args = parse(train, ["--out", str(tmp_path), "--corpus-chars", "20000", "--vocab-size", "400", "--dim", "32",
                         "--layers", "1", "--heads", "2", "--kv-heads", "1", "--ffn-hidden", "64", "--seq-len", "32",
                         "--batch-size", "4", "--max-steps", "3", "--minutes", "1"])
    assert train.run(args) == 0
    report = json.loads((tmp_path / "training.json").read_text())
    assert report["steps"] == 3 and report["val_bits_per_byte"] > 0
    engine = AsyncLLMEngine.from_dir(tmp_path)
    text, ids, _ = engine.generate(engine.tokenizer.encode("import"), SamplingParams(max_tokens=4, seed=0))
    assert len(ids) == 4 and engine.info()["vocab_size"] == 400
    engine.shutdown()
