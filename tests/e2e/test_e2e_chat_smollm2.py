"""`make serve`'s default text model through the whole stack: conftest's `smollm2_stack` (the text and http apps,
ports GENSERVE_E2E_GRPC_PORT + 40..., one start per run) serving the fetched SmolLM2 GGUF, asked with `genserve chat`
and in the browser playground (Debian's Chromium; with GENSERVE_SCREENSHOTS=1 it also writes
docs/img/playground-chat-*.png)."""

from __future__ import annotations

import io

import pytest

from genserve.services.client import Client
from genserve.services.client.cli import main
from tests.e2e.playground import ask, chromium, page_at, partial_renders, screenshot, wait_ready, watch_answer

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"


def test_info_names_the_served_gguf(smollm2_stack, capsys) -> None:
    assert main(["info", "--address", smollm2_stack.address]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines() if " " in line.strip())
    assert lines["model_name"] == "SmolLM2-135M-Instruct.Q4_1" and lines["quantization"] == "Q4_1"
    assert lines["model_path"].endswith(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert lines["max_context"] == "8192"


def test_greedy_text_with_speculation_is_the_engines_without_it_and_info_shows_the_rate(smollm2_stack,
                                                                                        capsys) -> None:
    """The stack speculates (n-gram drafts, conftest's smollm2_stack); an input-grounded greedy request gives the
    tokens of the same GGUF in this process without speculation, and `genserve info` shows the method and the
    acceptance rate so far."""
    from genserve.services.text import default_model
    from genserve.services.text.engine.async_engine import AsyncLLMEngine
    from genserve.services.text.engine.params import SamplingParams

    passage = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
               "    return total / len(values)\n")
    prompt = f"{passage}\n# The same function again, unchanged:\n{passage[:30]}"
    with Client(smollm2_stack.address, timeout=120) as client:
        served = client.generate(prompt=prompt, max_tokens=48, temperature=0)
    engine = AsyncLLMEngine.from_dir(str(default_model.cached()))
    try:
        text, ids, _ = engine.generate(engine.tokenizer.encode(prompt), SamplingParams(max_tokens=48, temperature=0))
    finally:
        engine.shutdown()
    assert list(served.token_ids) == ids and served.text == text
    assert main(["info", "--address", smollm2_stack.address]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines() if " " in line.strip())
    assert lines["speculative"] == "ngram" and int(lines["spec_accepted_tokens"]) > 0
    assert 0 < float(lines["spec_acceptance_rate"]) <= 1


def test_chat_one_shot_answers_paris(smollm2_stack, capsys) -> None:
    assert main(["chat", QUESTION, "--address", smollm2_stack.address, "--timeout", "120"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_interactive_chat_streams_and_keeps_the_history(smollm2_stack, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{QUESTION}\nAnd its population?\n"))
    assert main(["chat", "--address", smollm2_stack.address, "--timeout", "120"]) == 0
    first, second = capsys.readouterr().out.split("> ")[1:3]
    assert "Paris" in first and second.strip()
    with Client(smollm2_stack.address, timeout=120) as client:
        chunks = list(client.generate_stream(messages=[{"role": "user", "content": QUESTION}], temperature=0))
    assert sum(bool(c.text) for c in chunks) >= 5 and chunks[-1].finish_reason == "eos"
    assert "Paris" in "".join(c.text for c in chunks)


def test_the_playground_streams_paris_from_the_default_model(smollm2_stack) -> None:
    with chromium() as browser, page_at(browser, f"http://127.0.0.1:{smollm2_stack.http_port}/") as page:
        wait_ready(page)
        page.get_by_role("spinbutton", name="Temperature").fill("0")
        page.get_by_role("spinbutton", name="Max tokens").fill("32")
        watch_answer(page)
        ask(page, QUESTION)
        answer = page.locator(".message.assistant").last
        text = answer.locator(".content").text_content()
        assert "Paris" in text
        # This stack speculates (n-gram drafts): a verify pass can emit up to 5 tokens in one delta, and this 8-token
        # answer copies "capital of France" from the question, so it may grow in as few as three renders.
        assert len(partial_renders(page, text)) >= 2, "the answer did not stream in"
        assert "tok/s" in answer.locator(".stats").text_content()
        screenshot(page, "chat")
