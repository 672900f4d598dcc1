"""``PagedBatch.to``: a step's index tensors reach the model's device in one host-to-device copy, not one per field
(issue 37, defect 8), with every field's values, shape and dtype kept."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from genserve.shared.blocks.paged import PagedBatch, PrefillChunk


def _batch() -> PagedBatch:
    """Two decode rows, then two prefill chunks of 3 and 2 tokens."""
    return PagedBatch(
        input_ids=torch.tensor([5, 6, 7, 8, 9, 10, 11]), positions=torch.tensor([4, 9, 0, 1, 2, 16, 17]),
        slots=torch.tensor([20, 41, 48, 49, 50, 64, 65]),
        decode_tables=torch.tensor([[1, 0], [2, 3]], dtype=torch.int32),
        decode_lens=torch.tensor([5, 10], dtype=torch.int32),
        prefills=(PrefillChunk(2, 3, 0, torch.tensor([12])), PrefillChunk(5, 2, 16, torch.tensor([7, 4]))),
        logits_index=torch.tensor([0, 1, 4, 6]))


def _fields(batch: PagedBatch) -> list[torch.Tensor]:
    return [batch.input_ids, batch.positions, batch.slots, batch.decode_tables, batch.decode_lens,
            batch.logits_index, *(c.table for c in batch.prefills)]


class _HostToDeviceCopies(TorchDispatchMode):
    """Counts the ops that take a CPU tensor and give one on another device."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.count += any(t.device.type == "cpu" for t in inputs) and any(t.device.type != "cpu" for t in outputs)
        return out


def test_a_step_crosses_to_the_device_in_one_copy() -> None:
    batch = _batch()
    with _HostToDeviceCopies() as copies:
        moved = batch.to(torch.device("meta"))  # a device without memory: what crosses is counted, not run
    assert copies.count == 1
    for before, after in zip(_fields(batch), _fields(moved), strict=True):
        assert after.device.type == "meta" and after.shape == before.shape and after.dtype == before.dtype
    assert [(c.offset, c.length, c.start) for c in moved.prefills] == [(2, 3, 0), (5, 2, 16)]


def test_the_packed_copy_keeps_every_value() -> None:
    batch = _batch()
    # "cpu:0" compares unequal to the tensors' own "cpu", so the packing and splitting run, on tensors we can read.
    moved = batch.to(torch.device("cpu", 0))
    assert moved is not batch
    for before, after in zip(_fields(batch), _fields(moved), strict=True):
        assert after.dtype == before.dtype and torch.equal(after, before)


def test_a_batch_already_on_the_device_is_not_copied() -> None:
    batch = _batch()
    assert batch.to(torch.device("cpu")) is batch
