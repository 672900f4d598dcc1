"""The dispatch point: backends agree with each other, names resolve from the argument or $GENSERVE_BACKEND."""

from __future__ import annotations

import pytest
import torch

from genserve.shared.blocks.backend import AutoBackend, ReferenceBackend, TorchBackend, get_backend
from genserve.shared.blocks.rope import rope_cos_sin


@pytest.fixture
def ref() -> ReferenceBackend:
    return get_backend("reference")


@pytest.fixture
def fused() -> TorchBackend:
    return get_backend("torch")


@pytest.mark.parametrize(("hq", "hkv", "nq", "nk"), [(4, 4, 8, 8), (8, 2, 8, 8), (8, 2, 3, 11), (4, 1, 1, 9)])
@pytest.mark.parametrize("causal", [False, True])
def test_attend_reference_equals_torch(ref, fused, hq, hkv, nq, nk, causal) -> None:
    q, k, v = torch.randn(2, hq, nq, 16), torch.randn(2, hkv, nk, 16), torch.randn(2, hkv, nk, 16)
    for scale in (None, 0.2):
        a = ref.attend(q, k, v, causal=causal, sm_scale=scale)
        b = fused.attend(q, k, v, causal=causal, sm_scale=scale)
        assert torch.allclose(a, b, atol=1e-5)


def test_paged_decode_equals_attention_over_the_gathered_sequence(ref, fused) -> None:
    """Layout of docs/architecture.md: token t lives in block block_tables[b, t // bs], slot t % bs."""
    n_blocks, bs, hkv, hq, d = 12, 4, 2, 8, 16
    k_cache, v_cache = torch.randn(n_blocks, bs, hkv, d), torch.randn(n_blocks, bs, hkv, d)
    context_lens = torch.tensor([5, 12, 1], dtype=torch.int32)
    block_tables = torch.tensor([[7, 2, 99, 99], [0, 5, 9, -1], [11, 0, 0, 0]], dtype=torch.int32)  # 99/-1: unused
    q = torch.randn(3, hq, d)
    out_ref = ref.paged_decode(q, k_cache, v_cache, block_tables, context_lens)
    out_torch = fused.paged_decode(q, k_cache, v_cache, block_tables, context_lens)
    assert out_ref.shape == (3, hq, d)
    assert torch.allclose(out_ref, out_torch, atol=1e-5)
    for b in range(3):
        n = int(context_lens[b])
        ids = [int(block_tables[b, t // bs]) for t in range(n)]
        slots = [t % bs for t in range(n)]
        k = k_cache[ids, slots].transpose(0, 1)[None]  # (1, Hkv, n, D)
        v = v_cache[ids, slots].transpose(0, 1)[None]
        expected = ref.attend(q[b, None, :, None], k, v, causal=False)[0, :, 0]
        assert torch.allclose(out_ref[b], expected, atol=1e-5)


@pytest.mark.parametrize("grad", [False, True])
def test_conv2d_and_group_norm_reference_equal_torch(ref, fused, grad) -> None:
    """The torch backend runs both on its CPU kernels for inference and on torch ops when a gradient is needed."""
    from genserve.shared.blocks.backend import PreparedWeights

    x, w, b = torch.randn(2, 16, 6, 6), torch.randn(32, 16, 3, 3, requires_grad=grad), torch.randn(32)
    with torch.set_grad_enabled(grad):
        for stride, padding in (((1, 1), (1, 1)), ((2, 2), (0, 0))):
            a = ref.conv2d(x, w, b, stride=stride, padding=padding)
            c = fused.conv2d(x, w, b, stride=stride, padding=padding, prepared=PreparedWeights())
            torch.testing.assert_close(a, c, atol=1e-4, rtol=1e-5)
        y, g = fused.conv2d(x, w, b, stride=(1, 1), padding=(1, 1)), torch.randn(32)
        for silu in (False, True):
            torch.testing.assert_close(ref.group_norm(y, 4, g, b, 1e-6, silu=silu),
                                       fused.group_norm(y, 4, g, b, 1e-6, silu=silu), atol=1e-5, rtol=1e-5)
    assert a.requires_grad == grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reference_equals_torch(ref, fused, dtype) -> None:
    x, res, w = torch.randn(3, 5, 32, dtype=dtype), torch.randn(3, 5, 32, dtype=dtype), torch.randn(32, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(ref.rms_norm(x, w, 1e-6), fused.rms_norm(x, w, 1e-6), atol=tol)
    (y1, r1), (y2, r2) = ref.rms_norm(x, w, 1e-6, res), fused.rms_norm(x, w, 1e-6, res)
    assert torch.equal(r1, x + res) and torch.equal(r2, x + res)
    assert torch.allclose(y1, y2, atol=tol)
    assert torch.allclose(y1, ref.rms_norm(x + res, w, 1e-6), atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_reference_equals_torch(ref, fused, interleaved) -> None:
    cos, sin = rope_cos_sin(16, 32)
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]])
    (q1, k1), (q2, k2) = (
        ref.apply_rope(q, k, cos, sin, pos, interleaved=interleaved),
        fused.apply_rope(q, k, cos, sin, pos, interleaved=interleaved),
    )
    assert torch.allclose(q1, q2) and torch.allclose(k1, k2)
    assert torch.allclose(q1.norm(dim=-1), q.norm(dim=-1), atol=1e-5)  # rotations preserve norms


def test_get_backend_reads_name_then_environment(monkeypatch) -> None:
    monkeypatch.delenv("GENSERVE_BACKEND", raising=False)
    assert isinstance(get_backend(), AutoBackend)
    monkeypatch.setenv("GENSERVE_BACKEND", "reference")
    assert isinstance(get_backend(), ReferenceBackend)
    assert get_backend("torch").name == "torch"
    assert get_backend("triton").name == "triton"
    with pytest.raises(ValueError, match="unknown backend"):
        get_backend("cuda")
    monkeypatch.setenv("GENSERVE_BACKEND", "nope")
    with pytest.raises(ValueError, match="GENSERVE_BACKEND"):
        get_backend()


def test_auto_uses_torch_for_cpu_tensors() -> None:
    auto = AutoBackend()
    q = torch.randn(1, 2, 3, 8)
    assert auto._pick(q).name == "torch"
    assert torch.allclose(auto.attend(q, q, q, causal=True), get_backend("torch").attend(q, q, q, causal=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_keeps_autograd_on_cuda_and_runs_the_kernels_without_it(ref) -> None:
    """The kernels are forward-only: training on a GPU must get the reference gradient; inference the kernels."""
    auto = AutoBackend()
    q, k, v = (torch.randn(1, 4, 40, 64, device="cuda", requires_grad=True) for _ in range(3))
    out = auto.attend(q, k, v, causal=True)
    grad = torch.autograd.grad(out.square().sum(), q)[0]
    q_ref = q.detach().cpu().requires_grad_()
    expected = ref.attend(q_ref, k.detach().cpu(), v.detach().cpu(), causal=True)
    torch.testing.assert_close(grad.cpu(), torch.autograd.grad(expected.square().sum(), q_ref)[0], atol=1e-3,
                               rtol=1e-3)
    with torch.no_grad():
        assert auto._pick(q).name == "triton"
        torch.testing.assert_close(auto.attend(q, k, v, causal=True).cpu(), expected.detach(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("window", [3, 8])
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_sliding_window_attention_agrees_across_backends(ref, name, window) -> None:
    """attend(window=) and paged_decode(window=) against the reference's one window mask (masks.py)."""
    if name == "triton":
        pytest.importorskip("triton", reason="triton is not installed on this platform")
    backend = get_backend(name)
    q, k, v = torch.randn(1, 4, 6, 32), torch.randn(1, 2, 11, 32), torch.randn(1, 2, 11, 32)  # chunked prefill
    expected = ref.attend(q, k, v, causal=True, window=window)
    torch.testing.assert_close(backend.attend(q, k, v, causal=True, window=window), expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(expected, ref.attend(q, k, v, causal=True), atol=1e-3)
    k_cache, v_cache = torch.randn(6, 4, 2, 32), torch.randn(6, 4, 2, 32)
    tables = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([7, 11], dtype=torch.int32)
    qd = torch.randn(2, 4, 32)
    expected = ref.paged_decode(qd, k_cache, v_cache, tables, lens, window=window)
    out = backend.paged_decode(qd, k_cache, v_cache, tables, lens, window=window)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    # the reference's window is the last `window` keys of the gathered sequence
    ids = [int(tables[1, t // 4]) for t in range(11 - window, 11)]
    kw, vw = (c[ids, [t % 4 for t in range(11 - window, 11)]].transpose(0, 1)[None] for c in (k_cache, v_cache))
    torch.testing.assert_close(expected[1], ref.attend(qd[1, None, :, None], kw, vw, causal=False)[0, :, 0])


def test_triton_backend_agrees_with_reference() -> None:
    """The dispatch wiring to kernels/: on CPU this runs the kernels under TRITON_INTERPRET=1 (tests/conftest.py)."""
    pytest.importorskip("triton", reason="triton is not installed on this platform")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tri, ref = get_backend("triton"), get_backend("reference")
    q, k, v = (torch.randn(1, h, n, 64, device=dev) for h, n in ((4, 8), (2, 12), (2, 12)))
    assert torch.allclose(tri.attend(q, k, v, causal=True), ref.attend(q, k, v, causal=True), atol=1e-4)
    x, w, r = torch.randn(3, 64, device=dev), torch.randn(64, device=dev), torch.randn(3, 64, device=dev)
    (y1, r1), (y2, r2) = tri.rms_norm(x, w, 1e-6, r), ref.rms_norm(x, w, 1e-6, r)
    assert torch.allclose(y1, y2, atol=1e-4) and torch.allclose(r1, r2)
    cos, sin = (t.to(dev) for t in rope_cos_sin(64, 32))
    pos = torch.arange(3, 11, device=dev)
    (q1, k1), (q2, k2) = (
        tri.apply_rope(q.clone(), q[:, :2].clone(), cos, sin, pos),
        ref.apply_rope(q, q[:, :2], cos, sin, pos),
    )
    assert torch.allclose(q1, q2, atol=1e-5) and torch.allclose(k1, k2, atol=1e-5)
    k_cache, v_cache = torch.randn(6, 4, 2, 64, device=dev), torch.randn(6, 4, 2, 64, device=dev)
    tables = torch.tensor([[3, 1, 0], [5, 0, 0]], dtype=torch.int32, device=dev)
    lens = torch.tensor([7, 2], dtype=torch.int32, device=dev)
    qd = torch.randn(2, 4, 64, device=dev)
    expected = ref.paged_decode(qd, k_cache, v_cache, tables, lens)
    assert torch.allclose(tri.paged_decode(qd, k_cache, v_cache, tables, lens), expected, atol=1e-4)
