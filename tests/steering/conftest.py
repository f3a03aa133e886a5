import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    # The toy and tiny models work on tensors far too small to split across threads; on a shared CPU the thread
    # hand-offs cost more than the arithmetic (10x slower here with 2 threads under load).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
