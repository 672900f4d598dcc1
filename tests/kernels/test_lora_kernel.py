"""The multi-LoRA Triton kernels (kernels/lora.py) against the torch block (shared/blocks/lora.py) on small shapes:
tokens of three adapters of different ranks and of the base model, interleaved, in one launch each."""

from __future__ import annotations

import pytest
import torch

from genserve.shared.blocks.lora import LoraMapping, LoraStack, lora_add

pytest.importorskip("triton", reason="triton is not installed on this platform")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_and_expand_match_the_grouped_torch_delta(dtype) -> None:
    from genserve.kernels.lora import lora_add as triton_lora_add

    gen = torch.Generator().manual_seed(0)
    n_in, n_out, ranks = 40, 72, (3, 8, 5)
    stack = LoraStack(4, 8, n_in, n_out)  # slot 3 stays empty
    for slot, r in enumerate(ranks):
        stack.write(slot, torch.randn(r, n_in, generator=gen), torch.randn(n_out, r, generator=gen))
    slots = torch.tensor([2, -1, 0, 0, 1, -1, 2, 1, 0, 2, 2, 1, -1, 0, 1, 2, 0, 1, -1], dtype=torch.int32)
    x = torch.randn(slots.numel(), n_in, generator=gen).to(dtype)
    y = torch.randn(slots.numel(), n_out, generator=gen).to(dtype)
    expected = lora_add(y.clone(), x, stack, LoraMapping(slots))
    got = triton_lora_add(y.clone(), x, stack.a, stack.b, slots, stack.ranks)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol * 10, rtol=tol)
    base = slots < 0
    assert torch.equal(got[base], y[base])  # the base model's rows are untouched
