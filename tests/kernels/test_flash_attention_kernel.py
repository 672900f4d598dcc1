"""genserve.kernels.flash_attention against the blocks' tiled-attention reference (Algorithm 3,
"Flash Attention (Simplified)", of the chapter "Deep Learning Building Blocks", in torch) and the written-out SDPA
(Definition 12, "Scaled Dot-Product Attention"): interpreted on CPU, compiled on a GPU (tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from genserve.kernels import flash_attention
from genserve.shared.blocks.masks import causal_mask
from genserve.shared.blocks.sdpa import scaled_dot_product_attention
from genserve.shared.blocks.tiled_attention import tiled_attention

# Max abs error against the fp32 reference on the same (rounded) inputs; bf16 also suffers the interpreter's
# truncating fp32 -> bf16 casts.
TOLERANCES = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 4e-2}
DTYPES = list(TOLERANCES)

# (B, Hq, Hkv, Nq, Nk, D): GQA ratios 1, 2, 4, 8; lengths that are not multiples of the 64-wide interpreter tiles;
# Nq < Nk (chunked prefill).
SHAPES = [
    pytest.param(1, 4, 4, 70, 70, 64, id="mha-ragged"),
    pytest.param(2, 4, 2, 80, 80, 64, id="gqa2"),
    pytest.param(1, 8, 2, 37, 237, 32, id="gqa4-chunked-prefill"),
    pytest.param(1, 8, 1, 40, 130, 128, id="mqa8-chunked-prefill"),
]


def _inputs(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, dtype: torch.dtype):
    q = torch.randn(b, hq, nq, d, dtype=dtype)
    k = torch.randn(b, hkv, nk, d, dtype=dtype)
    v = torch.randn(b, hkv, nk, d, dtype=dtype)
    return q, k, v


def _max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("b", "hq", "hkv", "nq", "nk", "d"), SHAPES)
def test_flash_attention_matches_sdpa_reference(b, hq, hkv, nq, nk, d, causal, dtype) -> None:
    q, k, v = _inputs(b, hq, hkv, nq, nk, d, dtype)
    out = flash_attention(q, k, v, causal=causal)
    ref = scaled_dot_product_attention(q.float(), k.float(), v.float(), causal_mask(nq, nk) if causal else None)
    assert out.shape == (b, hq, nq, d) and out.dtype == dtype
    assert _max_err(out, ref) <= TOLERANCES[dtype]


def _random_cases(n: int, seed: int) -> list:
    """Seeded random shapes: batch, GQA group, lengths (never a multiple of 64 by design), head dim, causality."""
    g = torch.Generator().manual_seed(seed)

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (1,), generator=g))]

    cases = []
    for _ in range(n):
        hkv, group = pick([1, 2]), pick([1, 2, 4, 8])
        nq = int(torch.randint(1, 100, (1,), generator=g))
        nk = nq + int(torch.randint(0, 80, (1,), generator=g))
        nq, nk = nq + (nq % 64 == 0), nk + (nk % 64 == 0)
        b, d, causal = pick([1, 2]), pick([16, 32, 64]), pick([True, False])
        name = f"b{b}-h{hkv * group}:{hkv}-n{nq}x{nk}-d{d}-{'causal' if causal else 'full'}"
        cases.append(pytest.param(b, hkv * group, hkv, nq, nk, d, causal, id=name))
    return cases


@pytest.mark.parametrize(("b", "hq", "hkv", "nq", "nk", "d", "causal"), _random_cases(6, seed=1234))
def test_flash_attention_random_shapes_fp16(b, hq, hkv, nq, nk, d, causal) -> None:
    q, k, v = _inputs(b, hq, hkv, nq, nk, d, torch.float16)
    out = flash_attention(q, k, v, causal=causal)
    ref = scaled_dot_product_attention(q.float(), k.float(), v.float(), causal_mask(nq, nk) if causal else None)
    assert _max_err(out, ref) <= TOLERANCES[torch.float16]


def test_flash_attention_rows_that_see_no_key_are_zero() -> None:
    # Nq > Nk, bottom-right causal: query i sees keys j <= i - 6, so the first 6 queries see nothing.
    q, k, v = _inputs(1, 2, 1, 10, 4, 32, torch.float32)
    out = flash_attention(q, k, v, causal=True)
    assert torch.equal(out[:, :, :6], torch.zeros_like(out[:, :, :6]))
    ref = scaled_dot_product_attention(q[:, :, 6:], k, v, causal_mask(4, 4))
    assert _max_err(out[:, :, 6:], ref) <= TOLERANCES[torch.float32]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flash_attention_matches_tiled_algorithm3_reference(causal) -> None:
    q, k, v = _inputs(1, 4, 2, 37, 101, 32, torch.float32)
    ref = tiled_attention(q, k, v, causal=causal)
    assert _max_err(flash_attention(q, k, v, causal=causal), ref) <= TOLERANCES[torch.float32]


def test_flash_attention_single_query_sees_every_key() -> None:
    q, k, v = _inputs(2, 4, 2, 1, 150, 64, torch.float32)
    ref = scaled_dot_product_attention(q, k, v)
    assert _max_err(flash_attention(q, k, v, causal=True), ref) <= TOLERANCES[torch.float32]


def test_flash_attention_honours_sm_scale() -> None:
    q, k, v = _inputs(1, 2, 1, 50, 90, 64, torch.float32)
    out = flash_attention(q, k, v, causal=True, sm_scale=0.3)
    ref = scaled_dot_product_attention(q, k, v, causal_mask(50, 90), sm_scale=0.3)
    assert _max_err(out, ref) <= TOLERANCES[torch.float32]


def test_flash_attention_reads_strided_token_major_inputs() -> None:
    # (B, N, H, D) projections viewed as (B, H, N, D) without a copy, as the text model produces them.
    q, k, v = (torch.randn(2, 80, h, 64).transpose(1, 2) for h in (4, 2, 2))
    out = flash_attention(q, k, v, causal=True)
    ref = scaled_dot_product_attention(q, k, v, causal_mask(80, 80))
    assert _max_err(out, ref) <= TOLERANCES[torch.float32]
    # the output is laid out token-major too, so merging heads is a view
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flash_attention_varlen_matches_per_sequence_reference(causal, dtype) -> None:
    q_lens, k_lens = [5, 70, 33], [5, 130, 90]
    hq, hkv, d = 4, 1, 64
    q = torch.randn(sum(q_lens), hq, d, dtype=dtype)
    k = torch.randn(sum(k_lens), hkv, d, dtype=dtype)
    v = torch.randn(sum(k_lens), hkv, d, dtype=dtype)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = flash_attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert out.shape == q.shape
    for i in range(len(q_lens)):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        # (T, H, D) -> (1, H, T, D)
        q_i, k_i, v_i = (t[s].float().transpose(0, 1)[None] for t, s in ((q, qs), (k, ks), (v, ks)))
        mask = causal_mask(q_lens[i], k_lens[i]) if causal else None
        ref = scaled_dot_product_attention(q_i, k_i, v_i, mask)[0].transpose(0, 1)
        assert _max_err(out[qs], ref) <= TOLERANCES[dtype], f"sequence {i}"


@pytest.mark.parametrize(("d", "dv"), [(40, 40), (80, 80), (24, 16)], ids=["d40", "d80", "mla-d24-dv16"])
def test_flash_attention_pads_odd_head_dims(d, dv) -> None:
    # Head dims that are not powers of two (diffusion U-Nets), and a value head narrower than q/k (MLA).
    q, k = torch.randn(1, 4, 45, d), torch.randn(1, 2, 90, d)
    v = torch.randn(1, 2, 90, dv)
    out = flash_attention(q, k, v, causal=True)
    assert out.shape == (1, 4, 45, dv)
    assert _max_err(out, scaled_dot_product_attention(q, k, v, causal_mask(45, 90))) <= TOLERANCES[torch.float32]


def test_flash_attention_rejects_unsupported_head_dim() -> None:
    q, k, v = _inputs(1, 2, 2, 8, 8, 320, torch.float32)
    with pytest.raises(ValueError, match="head dim"):
        flash_attention(q, k, v, causal=False)


def test_flash_attention_rejects_indivisible_head_groups() -> None:
    q, k, v = _inputs(1, 3, 2, 8, 8, 64, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        flash_attention(q, k, v, causal=False)


@pytest.mark.parametrize(("nq", "nk", "window"), [
    pytest.param(100, 100, 17, id="prefill-window-17"),
    pytest.param(70, 70, 64, id="prefill-window-one-tile"),
    pytest.param(37, 237, 50, id="chunked-prefill-window"),
    pytest.param(30, 30, 200, id="window-wider-than-keys"),
])
def test_flash_attention_sliding_window_matches_the_window_mask(nq, nk, window) -> None:
    from genserve.shared.blocks.masks import sliding_window_mask

    q, k, v = _inputs(1, 4, 2, nq, nk, 32, torch.float32)
    out = flash_attention(q, k, v, causal=True, window=window)
    ref = scaled_dot_product_attention(q, k, v, sliding_window_mask(nq, nk, window))
    assert _max_err(out, ref) <= TOLERANCES[torch.float32]
    if window < nk:  # the window must actually cut something off
        assert _max_err(flash_attention(q, k, v, causal=True), ref) > 1e-3


def test_flash_attention_refuses_a_window_without_causality() -> None:
    q, k, v = _inputs(1, 2, 2, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="window"):
        flash_attention(q, k, v, causal=False, window=4)


@pytest.mark.parametrize(("softcap", "with_sinks"), [(2.0, False), (0.0, True), (3.0, True)],
                         ids=["softcap", "sinks", "both"])
def test_flash_attention_soft_capping_and_sinks_match_the_written_out_attention(softcap, with_sinks) -> None:
    """Gemma 2's capped scores and gpt-oss's sink logits, over a chunked-prefill window (sdpa.py's reference)."""
    from genserve.shared.blocks.masks import sliding_window_mask

    q, k, v = _inputs(1, 4, 2, 37, 101, 32, torch.float32)
    q = 3 * q  # scores large enough that the cap bends them
    sinks = torch.tensor([0.5, -1.0, 2.0, 4.0]) if with_sinks else None
    out = flash_attention(q, k, v, causal=True, window=40, softcap=softcap, sinks=sinks)
    ref = scaled_dot_product_attention(q, k, v, sliding_window_mask(37, 101, 40), softcap=softcap, sinks=sinks)
    assert _max_err(out, ref) <= TOLERANCES[torch.float32]
    plain = scaled_dot_product_attention(q, k, v, sliding_window_mask(37, 101, 40))
    assert _max_err(plain, ref) > 1e-2  # the variant changed the result
