"""The kimi-k3-tiny fixtures shared by the K3 tests: the make-model folder (once per session)
and an LLM factory on it whose engines must end with every pool free."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def k3_tiny_dir(tmp_path_factory) -> str:
    from kdaserve.models.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("kimi_k3_tiny")), preset="kimi-k3-tiny")


@pytest.fixture
def make_k3_llm(k3_tiny_dir):
    from tests.engine.conftest import llm_factory

    yield from llm_factory(k3_tiny_dir)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tiny model runs many small ops; on a loaded CPU the OpenMP pool's spin-waits make
    them many times slower. One thread while the importing module runs, restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
