"""Every kernel, at the tile sizes it launches with on Hopper, builds for sm_90 (no GPU needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Hopper's largest dynamic shared memory per block (227 KB): a config over it would fail to launch on the GPU.
SM90_MAX_SHARED = 232448
# Stack bytes per thread above this are register spills to local memory in the inner loop.
MAX_STACK_BYTES = 64
EXPECTED = ("flash_attention[", "paged_decode[", "paged_decode_merge", "mla_decode[", "rms_norm[", "rope[",
            "quant_matmul[",
            "fused_moe[gate_up]", "fused_moe[down]",
            # fp32 at Stable Diffusion's head dims (the U-Net runs fp32 on a GPU): padded to 64, 128 and 256
            "flash_attention[fp32,D40,", "flash_attention[fp32,D80,", "flash_attention[fp32,D160,")


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("sm90_compile.py"))],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in results if "error" in r]
    assert proc.returncode == 0 and not failed, f"sm_90 build failed: {failed or proc.stderr[-3000:]}"
    return results


def test_every_kernel_builds_for_sm90(compiled: list[dict]) -> None:
    names = [r["name"] for r in compiled]
    for prefix in EXPECTED:
        assert any(n.startswith(prefix) for n in names), f"no sm_90 build of {prefix}: {names}"


def test_sm90_builds_fit_in_shared_memory(compiled: list[dict]) -> None:
    too_big = {r["name"]: r["shared"] for r in compiled if r["shared"] > SM90_MAX_SHARED}
    assert not too_big, f"over {SM90_MAX_SHARED} bytes of shared memory: {too_big}"


def test_flash_attention_uses_hopper_tensor_cores(compiled: list[dict]) -> None:
    # fp32 products are exact ("ieee"), which the tensor cores do not compute
    flash = [r for r in compiled if r["name"].startswith("flash_attention[") and "fp32" not in r["name"]]
    assert flash and all(r["wgmma"] for r in flash), flash


def test_attention_and_quant_builds_do_not_spill_registers(compiled: list[dict]) -> None:
    # fp32 flash attention multiplies exactly on the FMA units, whose wide tiles live in registers: its builds are
    # checked for fitting and compiling (above), not for spills, a cost the 16-bit path must not pay.
    attention = [r for r in compiled if r["name"].startswith(("flash_attention[", "paged_decode[", "mla_decode[",
                                                               "quant_matmul[", "fused_moe["))
                 and "fp32" not in r["name"]]
    if any(r["stack"] is None for r in attention):
        pytest.skip("cuobjdump is not available to read register usage")
    spilling = {r["name"]: r["stack"] for r in attention if r["stack"] > MAX_STACK_BYTES}
    assert not spilling, f"stack bytes per thread over {MAX_STACK_BYTES} (register spills): {spilling}"


def test_fp32_flash_attention_has_two_candidates_that_fit_at_every_sd_head_dim(compiled: list[dict]) -> None:
    """Two or more, so the autotuner times them and drops one that fails to launch rather than launching it blind."""
    for d in (40, 80, 160):
        builds = [r for r in compiled if r["name"].startswith(f"flash_attention[fp32,D{d},")]
        assert len(builds) >= 2 and all(r["shared"] <= SM90_MAX_SHARED for r in builds), builds
