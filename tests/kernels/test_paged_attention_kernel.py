"""genserve.kernels.paged_decode_attention against the reference backend's paged decode, over block tables with holes,
shared prefix blocks and garbage past each sequence's end, with and without split-K."""

from __future__ import annotations

import pytest
import torch

from genserve.kernels import paged_decode_attention
from genserve.shared.blocks.backend import get_backend

TOLERANCES = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 4e-2}
BLOCK_SIZE = 16
NUM_BLOCKS = 48


def _paged_batch(context_lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype):
    """A cache whose blocks are handed out in random order (holes between a sequence's blocks), where sequence 1
    shares sequence 0's first two blocks (a common prompt prefix) and unused table entries hold -1."""
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, hkv, d, dtype=dtype)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, hkv, d, dtype=dtype)
    max_blocks = max(-(-n // BLOCK_SIZE) for n in context_lens) + 1
    free = torch.randperm(NUM_BLOCKS).tolist()
    tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    for b, n in enumerate(context_lens):
        for i in range(-(-n // BLOCK_SIZE)):
            tables[b, i] = tables[0, i] if b == 1 and i < 2 else free.pop()
    q = torch.randn(len(context_lens), hq, d, dtype=dtype)
    return q, k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32)


def _reference(q, k_cache, v_cache, tables, lens) -> torch.Tensor:
    return get_backend("reference").paged_decode(q.float(), k_cache.float(), v_cache.float(), tables, lens)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_paged_decode_matches_reference(group, dtype) -> None:
    hkv = 2 if group < 8 else 1
    inputs = _paged_batch([100, 45, 1], hkv * group, hkv, 64, dtype)
    out = paged_decode_attention(*inputs)
    assert out.shape == inputs[0].shape and out.dtype == dtype
    assert (out.float() - _reference(*inputs)).abs().max().item() <= TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_decode_split_k_matches_reference(dtype) -> None:
    # 300 tokens in 256-token splits: two splits for the long sequence, one empty split for the short ones.
    inputs = _paged_batch([300, 40, 17], 8, 2, 128, dtype)
    out = paged_decode_attention(*inputs, num_splits=2)
    assert (out.float() - _reference(*inputs)).abs().max().item() <= TOLERANCES[dtype]


def test_paged_decode_split_k_agrees_with_single_pass() -> None:
    inputs = _paged_batch([300, 200], 4, 2, 32, torch.float32)
    one = paged_decode_attention(*inputs, num_splits=1)
    split = paged_decode_attention(*inputs, num_splits=2)
    torch.testing.assert_close(split, one, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_pads_odd_head_dims(num_splits) -> None:
    inputs = _paged_batch([290, 7], 4, 2, 40, torch.float32)
    out = paged_decode_attention(*inputs, num_splits=num_splits)
    assert (out - _reference(*inputs)).abs().max().item() <= TOLERANCES[torch.float32]


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_is_exact_when_max_context_len_underestimates(num_splits) -> None:
    # Splits sized for 300 tokens: the last one must still cover the rest of a 700-token context.
    inputs = _paged_batch([700, 60], 4, 2, 32, torch.float32)
    out = paged_decode_attention(*inputs, max_context_len=300, num_splits=num_splits)
    assert (out - _reference(*inputs)).abs().max().item() <= TOLERANCES[torch.float32]


def test_paged_decode_honours_sm_scale() -> None:
    q, k_cache, v_cache, tables, lens = _paged_batch([70, 33], 4, 2, 64, torch.float32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, sm_scale=0.2)
    ref = get_backend("reference").paged_decode(q, k_cache, v_cache, tables, lens, sm_scale=0.2)
    assert (out - ref).abs().max().item() <= TOLERANCES[torch.float32]


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_empty_context_gives_zeros(num_splits) -> None:
    q, k_cache, v_cache, tables, lens = _paged_batch([300, 0], 4, 2, 64, torch.float32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out).all()


def test_paged_decode_rejects_int64_tables() -> None:
    q, k_cache, v_cache, tables, lens = _paged_batch([20], 2, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, k_cache, v_cache, tables.long(), lens)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_sliding_window_sees_only_the_last_window_keys(num_splits) -> None:
    # Windows shorter and longer than the contexts; with two splits, the long sequence's first split is empty.
    inputs = _paged_batch([300, 40, 17], 8, 2, 64, torch.float32)
    window = 33
    out = paged_decode_attention(*inputs, window=window, num_splits=num_splits)
    ref = get_backend("reference").paged_decode(*inputs, window=window)
    assert (out - ref).abs().max().item() <= TOLERANCES[torch.float32]
    assert (out - _reference(*inputs)).abs().max().item() > 1e-3  # the window changed the answer


def test_paged_decode_spreads_a_short_context_over_the_splits_of_a_launch_sized_for_a_long_one(monkeypatch) -> None:
    """A CUDA graph's decode launch is sized by the model's maximum context (its block table's width); a 600-token
    sequence in a table 16k tokens wide must still run on ceil(600 / 256) splits, not on the first one alone."""
    from genserve.kernels import paged_attention

    q, k_cache, v_cache, tables, lens = _paged_batch([600], 2, 1, 16, torch.float32)
    wide = torch.zeros(1, 16384 // BLOCK_SIZE, dtype=torch.int32)
    wide[:, : tables.shape[1]] = tables
    busy = []
    merge = paged_attention._merge_splits_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(part_acc, part_m, part_l, *args, **kwargs):
                busy.append(int((part_l[0, 0] > 0).sum()))
                return merge[grid](part_acc, part_m, part_l, *args, **kwargs)
            return launch

    monkeypatch.setattr(paged_attention, "_merge_splits_kernel", Spy())
    out = paged_decode_attention(q, k_cache, v_cache, wide, lens)
    assert paged_attention.choose_num_splits(1, 1, 16384, q.device) == 8  # sized by the table: 2 waves of 4 "SMs"
    assert busy == [3]
    assert (out - _reference(q, k_cache, v_cache, wide, lens)).abs().max().item() <= TOLERANCES[torch.float32]


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_soft_capping_and_sinks_match_the_reference(num_splits) -> None:
    """The sink is counted once however the context is split; capped scores as in sdpa.py."""
    q, k_cache, v_cache, tables, lens = _paged_batch([300, 40, 17], 4, 2, 32, torch.float32)
    q = 3 * q
    sinks = torch.tensor([0.5, -1.0, 2.0, 4.0])
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=num_splits, softcap=2.5, sinks=sinks,
                                 window=200)
    ref = get_backend("reference").paged_decode(q, k_cache, v_cache, tables, lens, softcap=2.5, sinks=sinks, window=200)
    assert (out - ref).abs().max().item() <= TOLERANCES[torch.float32]
    plain = get_backend("reference").paged_decode(q, k_cache, v_cache, tables, lens, window=200)
    assert (plain - ref).abs().max().item() > 1e-2
