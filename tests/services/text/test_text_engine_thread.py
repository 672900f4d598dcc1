"""`AsyncLLMEngine.from_dir` loads the model on the engine's own thread, which then steps it: one thread opens every
parallel region of the model, so libgomp keeps one team of workers and spins at the decode step's barriers instead of
sleeping at each (what a Ray replica, whose loading thread is not the engine's, paid 269 context switches a token
for)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from genserve.services.text.engine.async_engine import ENGINE_THREAD, AsyncLLMEngine
from genserve.services.text.engine.params import SamplingParams


def test_the_thread_that_loads_the_model_is_the_one_that_steps_it(monkeypatch):
    loaders, steppers = [], set()
    load = AsyncLLMEngine._load.__func__

    def recording_load(cls, *args):
        loaders.append(threading.current_thread())
        engine = load(cls, *args)
        step = engine.engine.step

        def recording_step():
            steppers.add(threading.current_thread())
            return step()

        engine.engine.step = recording_step
        return engine

    monkeypatch.setattr(AsyncLLMEngine, "_load", classmethod(recording_load))
    engine = AsyncLLMEngine.from_dir()
    try:
        text, ids, reason = engine.generate(engine.tokenizer.encode("The with statement"),
                                            SamplingParams(max_tokens=8, temperature=0))
        assert len(ids) == 8 and reason == "length"
        assert loaders == [engine._thread] and steppers == {engine._thread}
        assert loaders[0] is not threading.current_thread() and loaders[0].name == ENGINE_THREAD
    finally:
        engine.shutdown()


def test_a_load_that_fails_raises_in_the_caller_and_leaves_no_thread(tmp_path):
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(FileNotFoundError):
        AsyncLLMEngine.from_dir(tmp_path / "missing")
    assert ENGINE_THREAD not in {t.name for t in threading.enumerate()} - before


# A process laid out like a replica: torch set to two threads on its main thread, which opens no parallel region;
# the engine loaded through from_dir. Prints the engine thread's voluntary context switches per decoded token.
REPLICA_LIKE = """
import asyncio, sys, threading, torch
from genserve.services.text.engine.async_engine import AsyncLLMEngine
from genserve.services.text.engine.params import SamplingParams
torch.set_num_threads(2)
engine = AsyncLLMEngine.from_dir()
prompt = engine.tokenizer.encode("The with statement")
def switches():
    status = open(f"/proc/self/task/{engine._thread.native_id}/status").read()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])
async def stream(n):
    return [t async for d in engine.stream(prompt, SamplingParams(max_tokens=n, temperature=0.7, seed=1))
            for t in d.token_ids]
asyncio.run(stream(16))
before = switches()
tokens = len(asyncio.run(stream(200)))
print((switches() - before) / tokens)
engine.shutdown()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_decode_steps_on_the_loading_thread_do_not_sleep_at_every_barrier():
    out = subprocess.run([sys.executable, "-P", "-c", REPLICA_LIKE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    per_token = float(out.stdout.split()[-1])
    # A second team of workers made every one of the step's ~20 barriers a futex sleep and wake (the demo model's
    # 4 layers); spinning teams switch only when the step's thread waits for work.
    assert per_token < 5, per_token
