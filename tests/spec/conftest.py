import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny-model ops are too small to split; on a loaded machine idle OpenMP threads spinning for work make
    them tens of times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
