"""`kernels` is this project's package (Triton kernels and their CPU fallbacks). Hugging Face's hub-kernels
distribution, which transformers 5.25 requires, ships a top-level `kernels` package too: with it installed, ours
shadows it in a checkout (transformers' model loading then fails on `from kernels import CUDAProperties`), and an
installed genserve shares site-packages/kernels/ with it. pyproject.toml keeps transformers below 5.25 for this."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

import kernels

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_is_this_projects_package() -> None:
    assert Path(kernels.__file__).resolve().parent == ROOT / "kernels"


def test_no_other_distribution_installs_a_kernels_package() -> None:
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("kernels")
