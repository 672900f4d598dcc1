"""`make gpu-check` cannot rot: its dry mode runs every section on the CPU at tiny sizes and prints the full table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_dry_run_prints_every_row() -> None:
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    checks = [line.split(" | ")[0].lstrip("| ") for line in table]
    assert checks[0] == "GPU-only tests (pytest -m gpu)"
    assert "0 failed" in table[0] and "skipped" in table[0]
    assert any(c.startswith("flash attention") for c in checks)
    assert any(c.startswith("paged decode") for c in checks)
    assert sum(c.startswith("text engine") for c in checks) == 2
    assert any(c.startswith("diffusion") for c in checks)
    assert not any("FAILED" in line for line in table)
    ratios = [line.split(" | ")[3] for line in table[1:]]
    assert all(r.endswith(("x", "%")) and float(r.rstrip("x%")) > 0 for r in ratios)


def test_gpu_check_refuses_to_run_without_a_gpu_unless_dry() -> None:
    if __import__("torch").cuda.is_available():
        pytest.skip("a GPU is here")
    done = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "--dry" in done.stdout
