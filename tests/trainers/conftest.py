"""Trainer tests run torch on one thread: the tiny models gain nothing from more, and on a shared, busy CPU
OpenMP threads spinning against each other make them 10-20x slower."""

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
