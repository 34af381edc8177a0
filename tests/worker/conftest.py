import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """These tests run many small ops; on a few shared cores, intra-op threads only add contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
