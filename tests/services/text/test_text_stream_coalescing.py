"""What a stream's consumer receives when it falls behind the engine: the tokens that waited for it as one delta,
in order, with stop strings cut exactly where they are when every token comes alone."""

from __future__ import annotations

import asyncio

import pytest

from genserve.services.text.engine.async_engine import AsyncLLMEngine
from genserve.services.text.engine.params import Delta, SamplingParams, TokenLogprob


@pytest.fixture(scope="module")
def demo() -> AsyncLLMEngine:
    engine = AsyncLLMEngine.from_dir()
    yield engine
    engine.shutdown()


def test_a_delta_then_a_later_one_is_both_in_order_with_the_later_finish_reason():
    first = Delta("ab", (1, 2), None, (TokenLogprob(1, -0.5), TokenLogprob(2, -1.0)))
    later = Delta("c", (3,), "stop", (TokenLogprob(3, -2.0),))
    assert first.then(later) == Delta("abc", (1, 2, 3), "stop",
                                      (TokenLogprob(1, -0.5), TokenLogprob(2, -1.0), TokenLogprob(3, -2.0)))


async def _slow_stream(engine: AsyncLLMEngine, prompt: list[int], params: SamplingParams,
                       pause_s: float) -> list[Delta]:
    """The stream's deltas, read by a consumer that is busy for `pause_s` after each."""
    got = []
    async for delta in engine.stream(prompt, params):
        got.append(delta)
        await asyncio.sleep(pause_s)
    return got


@pytest.mark.parametrize("options", [dict(temperature=0), dict(temperature=0.9, seed=5, logprobs=2)])
def test_a_consumer_that_falls_behind_gets_the_same_tokens_and_text_in_fewer_deltas(demo, options):
    prompt = demo.tokenizer.encode("The with statement")
    params = SamplingParams(max_tokens=40, **options)
    text, ids, reason = demo.generate(prompt, params)
    deltas = asyncio.run(_slow_stream(demo, prompt, params, pause_s=0.05))
    assert len(deltas) < len(ids) / 2  # 40 steps of the demo model take far less than 40 pauses
    assert [t for d in deltas for t in d.token_ids] == ids
    assert "".join(d.text for d in deltas) == text
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [reason]
    if options.get("logprobs"):
        assert [lp.token_id for d in deltas for lp in d.logprobs] == ids


def test_merged_deltas_cut_a_stop_string_where_single_tokens_do(demo):
    prompt = demo.tokenizer.encode("The with statement")
    free_text, _, _ = demo.generate(prompt, SamplingParams(max_tokens=40, temperature=0))
    words = free_text.split()
    stop = words[len(words) // 2]  # a word from the middle: the text must end right before it
    params = SamplingParams(max_tokens=40, temperature=0, stop=(stop,))
    text, ids, reason = demo.generate(prompt, params)
    assert reason == "stop" and stop not in text and free_text.startswith(text)
    deltas = asyncio.run(_slow_stream(demo, prompt, params, pause_s=0.05))
    assert "".join(d.text for d in deltas) == text
    assert [t for d in deltas for t in d.token_ids] == ids and deltas[-1].finish_reason == "stop"
