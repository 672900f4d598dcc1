"""The CPU runner's weights in one huge-page arena: same values, tied weights still tied, every tensor inside."""

from __future__ import annotations

import mmap

import pytest
import torch
from text_helpers import hf_model, make_engine, save_hf
from torch import nn

from genserve.services.text.runners.huge_pages import ALIGN, HUGE_PAGE, move_to_huge_pages

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 24)
        self.head = nn.Linear(24, 50, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(24)
        self.register_buffer("table", torch.arange(33, dtype=torch.float64).reshape(3, 11).t())  # not contiguous


def inside(arena: mmap.mmap, tensor: torch.Tensor) -> bool:
    start, nbytes = torch.frombuffer(arena, dtype=torch.uint8).data_ptr(), tensor.numel() * tensor.element_size()
    return start <= tensor.data_ptr() and tensor.data_ptr() + nbytes <= start + len(arena)


def test_tensors_move_with_their_values_and_ties_into_one_aligned_arena() -> None:
    torch.manual_seed(0)
    model = Tied()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    arena = move_to_huge_pages(model)
    assert arena is not None
    tensors = [*model.parameters(), *model.buffers()]
    assert len(tensors) == 4  # the tied weight once
    assert all(inside(arena, t) and t.data_ptr() % ALIGN == 0 for t in tensors)
    assert min(t.data_ptr() for t in tensors) % HUGE_PAGE == 0
    assert model.head.weight is model.embed.weight
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
    x = torch.randint(0, 50, (2, 5))
    assert model.head(model.norm(model.embed(x))).shape == (2, 5, 50)


def test_the_cpu_runner_serves_from_the_arena(tmp_path) -> None:
    """A tied Qwen2 checkpoint: its LM head is the embedding, in the arena like every other weight."""
    directory = save_hf(hf_model("qwen2", tie_word_embeddings=True), tmp_path, sharded=False)
    engine = make_engine(directory, block_size=4)
    arena = engine.runner.arena
    assert arena is not None
    assert all(inside(arena, p) for p in engine.model.parameters())
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
