import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    # The tiny pipelines' tensors are far too small to split across threads; on a shared, loaded CPU the
    # thread hand-offs cost several times the arithmetic.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
