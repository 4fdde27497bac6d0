"""Fixtures shared by the optimizer tests."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Python-bound tiny steps: one thread is 3-10x faster than contending for the shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
