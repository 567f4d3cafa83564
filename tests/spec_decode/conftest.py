import pytest
import torch

from tests.engine.conftest import hf_model, make_llm, tiny_model_dir  # noqa: F401


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """These tests run many tiny ops; on a loaded 2-core box the OpenMP pool's spin-waits make
    them 5-10x slower. One thread while this directory runs, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
