"""The replica's device: a replica that Ray gave a GPU refuses to start when torch cannot use one, rather than
serving on the CPU (issue 37, defect 1); one given none computes on the CPU."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from genserve.services.common.device import NoGpuError, assigned_gpus, serving_device
from genserve.services.text.engine.async_engine import AsyncLLMEngine

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a usable GPU")


def _fake_ray(monkeypatch: pytest.MonkeyPatch, gpu_ids: list[int]) -> None:
    ray = types.SimpleNamespace(is_initialized=lambda: True, get_gpu_ids=lambda: gpu_ids)
    monkeypatch.setitem(sys.modules, "ray", ray)


def test_a_replica_given_a_gpu_that_torch_cannot_use_refuses_to_start(monkeypatch) -> None:
    _fake_ray(monkeypatch, [0])
    assert assigned_gpus() == ["0"]
    with pytest.raises(NoGpuError, match=r"given GPU 0 \(num_gpus.*\).*refusing to serve on the CPU") as err:
        serving_device()
    assert torch.__version__ in str(err.value)


def test_the_text_engine_refuses_before_loading_when_its_gpu_is_missing(monkeypatch) -> None:
    _fake_ray(monkeypatch, [1])
    with pytest.raises(NoGpuError, match="given GPU 1"):
        AsyncLLMEngine.from_dir(None)


def test_a_replica_given_no_gpu_serves_on_the_cpu(monkeypatch) -> None:
    _fake_ray(monkeypatch, [])
    assert serving_device() == torch.device("cpu")


def test_a_process_outside_ray_serves_on_the_cpu(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert assigned_gpus() == [] and serving_device() == torch.device("cpu")
