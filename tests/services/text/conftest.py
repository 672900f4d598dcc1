"""Text-engine tests run torch on one thread: the tiny models gain nothing from more, and on a shared CPU extra
threads spin against each other."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
