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


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, request):
    """The rollout tests' tiny checkpoints (tests/rollout/fixtures.py model_dirs), made once per
    test module in a directory named after it."""
    from tests.rollout.fixtures import model_dirs
    return model_dirs(str(tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])))
