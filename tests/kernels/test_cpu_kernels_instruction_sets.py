"""The C kernels' value tests, run again against builds for other instruction-set levels than this machine's: the
rest of the suite checks the `-march=native` build; each case below rebuilds the kernels in a cache of its own with
GENSERVE_CPU_MARCH set and runs, in a fresh pytest, every test that compares a C kernel with its torch reference:
gemv, paged decode, group norm, the quantised products, the spatial transformer, and the fused decode step in fp32,
bf16, int8 and GGUF Q4_1/Q8_0 against the per-layer torch path and transformers. A level whose build would compile
the same code paths as the native one (an AVX2 CPU without AVX-512 and x86-64-v3) is skipped, saying so."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VALUE_TESTS = (
    "tests/kernels/test_cpu_kernels.py",
    "tests/kernels/test_quant_kernels.py",
    "tests/kernels/test_cpu_spatial_transformer.py",
    "tests/services/text/test_fused_decode_dtypes.py",
    "tests/services/text/test_text_hf_parity.py::test_fused_cpu_decode_steps_match_forward_paged",
    "tests/services/text/test_text_hf_parity.py::test_fused_cpu_decode_steps_match_forward_paged_at_widths_off_the_32_block",
    "tests/services/text/test_text_quant.py",
)

pytestmark = pytest.mark.slow
# The instruction sets kernels/csrc branches on (#if defined(...)): two builds that define the same ones compile the
# same code.
BRANCHES = ("__AVX512F__", "__AVX2__", "__FMA__", "__F16C__")


def _branches(cc: str, march: str) -> set[str]:
    """The BRANCHES that `cc -march=MARCH` defines."""
    macros = subprocess.run([cc, f"-march={march}", "-dM", "-E", "-"], input="", capture_output=True, text=True,
                            check=True).stdout
    return {name for name in BRANCHES if f"#define {name} " in macros}


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2 + FMA intrinsics; portable C (no vector ISA)
def test_the_c_kernels_value_tests_pass_when_built_for(march: str, cpu_kernels, tmp_path: Path) -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 instruction-set levels")
    from genserve.kernels import _cpu_library

    cc = _cpu_library.compiler()
    if _branches(cc, march) == _branches(cc, "native"):
        pytest.skip(f"-march=native compiles the same code paths as {march} on this CPU "
                    f"({', '.join(sorted(_branches(cc, march))) or 'no vector ISA'}): the rest of the suite tests them")
    env = dict(os.environ, GENSERVE_CPU_MARCH=march, GENSERVE_CACHE_DIR=str(tmp_path))
    env.pop("GENSERVE_CPU_KERNELS", None)
    done = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *VALUE_TESTS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary
    assert len(list(tmp_path.glob("cpu-kernels-*.so"))) == 1, "the kernels were not rebuilt for " + march
