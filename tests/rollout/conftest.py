import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """The TensorRT-LLM fake steps a tiny model token by token: intra-op threads only contend
    (20x slower on a loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
