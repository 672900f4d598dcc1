"""The CUDA runner's batch and memory handling, reached without a GPU: the Triton backend forced on CPU tensors
(the interpreter, tests/conftest.py) for its decode batches, and a faked device with a monkeypatched
``torch.cuda.mem_get_info`` for its KV-cache budget (issue 37, defects 2 and 3)."""

from __future__ import annotations

import pytest
import torch
from text_helpers import hf_model, save_hf

from genserve.services.text.loader import load_model
from genserve.services.text.runners import cuda
from genserve.services.text.runners.cuda import KV_HEADROOM_BYTES, CudaRunner
from genserve.shared.blocks.backend import get_backend
from genserve.shared.blocks.paged import PagedBatch

pytest.importorskip("triton", reason="triton is not installed on this platform")

GIB = 2**30
BLOCK = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.manual_seed(0)
    directory = save_hf(hf_model("llama"), tmp_path_factory.mktemp("llama"), sharded=False)
    return load_model(directory, backend=get_backend("triton"))


def _decode_batch(positions: list[int], sampled: list[int]) -> PagedBatch:
    """One decode token per sequence; sequence i owns block i. ``sampled``: the rows whose logits are wanted."""
    n = len(positions)
    return PagedBatch(
        input_ids=torch.tensor([7 + 11 * i for i in range(n)]), positions=torch.tensor(positions),
        slots=torch.tensor([i * BLOCK + p for i, p in enumerate(positions)]),
        decode_tables=torch.arange(n, dtype=torch.int32).view(n, 1),
        decode_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32), prefills=(),
        logits_index=torch.tensor(sampled))


def test_a_middle_row_that_does_not_sample_gets_no_logits_on_the_decode_path(model, monkeypatch) -> None:
    runner = CudaRunner(model, max_running=4)
    runner.allocate_kv_cache(num_blocks=4, block_size=BLOCK)
    assert runner.graphs is not None  # decode-only batches take the padded static buffers, as under CUDA graphs
    seen = []
    monkeypatch.setattr(cuda, "sample_batch", lambda logits, rows: seen.append(logits) or [(0, None)] * len(rows))
    batch = _decode_batch([3, 5, 2], sampled=[0, 2])  # the middle row: a one-token chunk that does not sample
    runner.execute(batch, rows=[None, None])
    with torch.inference_mode():
        expected = model.forward_paged(batch, runner.k_caches, runner.v_caches)  # (2, V): rows 0 and 2
    assert seen[0].shape == expected.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(seen[0], expected, atol=1e-4, rtol=1e-4)


def _budget(model, monkeypatch, *, free: int, total: int, fraction: float = 0.25, min_bytes: int = GIB) -> int:
    runner = CudaRunner(model)
    runner.device = torch.device("cuda", 0)  # the budget is all this test asks of the device
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    return runner.kv_cache_budget(0, fraction, min_bytes)


def test_the_kv_budget_is_a_fraction_of_the_total_whatever_is_free_at_start(model, monkeypatch) -> None:
    # Four apps on one 80 GiB GPU: the text replica starting first or last gets the same cache.
    first = _budget(model, monkeypatch, free=79 * GIB, total=80 * GIB)
    last = _budget(model, monkeypatch, free=40 * GIB, total=80 * GIB)
    assert first == last == 20 * GIB


def test_the_kv_budget_holds_at_least_one_full_context(model, monkeypatch) -> None:
    assert _budget(model, monkeypatch, free=70 * GIB, total=80 * GIB, fraction=0.01, min_bytes=3 * GIB) == 3 * GIB
    assert _budget(model, monkeypatch, free=70 * GIB, total=80 * GIB, fraction=0.0) == 40 * GIB  # the default half


def test_a_kv_budget_that_does_not_fit_in_free_memory_is_refused_by_name(model, monkeypatch) -> None:
    with pytest.raises(RuntimeError, match="kv_cache_fraction 0.25 of 80.0 GiB.*19.50 GiB are free"):
        _budget(model, monkeypatch, free=int(19.5 * GIB), total=80 * GIB)
    fits = 20 * GIB + KV_HEADROOM_BYTES
    assert _budget(model, monkeypatch, free=fits, total=80 * GIB) == 20 * GIB


def test_eager_decode_reads_only_the_batch_table_width(model, monkeypatch) -> None:
    """Graphs need tables as wide as the model's context; an eager step (graphs off, or the torch backend, which
    gathers whole tables) passes only the batch's own columns (defect 7)."""
    runner = CudaRunner(model, max_running=4)
    runner.allocate_kv_cache(num_blocks=4, block_size=BLOCK)
    assert runner.graphs.tables.shape[-1] == model.config.max_position // BLOCK == 32
    widths = []
    decode = model.backend.paged_decode
    monkeypatch.setattr(model.backend, "paged_decode",
                        lambda q, k, v, tables, *args, **kwargs: widths.append(tables.shape[1]) or
                        decode(q, k, v, tables, *args, **kwargs))
    monkeypatch.setattr(cuda, "sample_batch", lambda logits, rows: [(0, None)] * len(rows))
    runner.execute(_decode_batch([3, 5], sampled=[0, 1]), rows=[None, None])
    assert widths == [1] * model.config.n_layers

