"""Structured-output fixtures: the tiny preset model (`kdaserve make-model --preset tiny`: a
byte-level BPE tokenizer, so every schema's characters are tokens), one torch thread, and a
check that every LLM a test made ends with all KV blocks and state slots free."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import assert_pools_free


@pytest.fixture(scope="session")
def tiny_preset(tmp_path_factory) -> str:
    from kdaserve.models.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("so_tiny")), preset="tiny")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Many tiny ops on a loaded 2-core box: the OpenMP pool's spin-waits slow them down."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llms(tiny_preset):
    """LLM(**kwargs) on the tiny preset, one per distinct kwargs in the module; pools checked
    free at the end."""
    from kdaserve import LLM

    made: dict[str, LLM] = {}

    def get(**kwargs):
        key = repr(sorted(kwargs.items()))
        if key not in made:
            kwargs = {"max_model_len": 512, "num_gpu_blocks": 256,
                      "max_num_batched_tokens": 512, **kwargs}
            made[key] = LLM(tiny_preset, **kwargs)
        return made[key]

    yield get
    for llm in made.values():
        assert_pools_free(llm.llm_engine)


@pytest.fixture(scope="session")
def backend(tiny_preset):
    """An XgrammarBackend over the tiny preset's tokenizer and vocabulary."""
    import json
    import os

    from kdaserve.models.tokenizer import get_tokenizer
    from kdaserve.structured_output.backend_xgrammar import XgrammarBackend

    with open(os.path.join(tiny_preset, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    return XgrammarBackend(get_tokenizer(tiny_preset), vocab_size)
