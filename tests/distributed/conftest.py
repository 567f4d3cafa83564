"""Tensor-parallel test fixtures: the tiny presets of both families (kimi-k3-tiny with its
expert width doubled so that MXFP4 experts split over 2 ranks on whole scale groups), and an
LLM runner that shuts every engine's rank processes down."""

from __future__ import annotations

import json
import math
import os

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    from kdaserve.models.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("tp_tiny")), preset="tiny")


@pytest.fixture(scope="session")
def hf_tiny_dir(tmp_path_factory) -> str:
    """The transformers-saved tiny model (Moonshot's checkpoint names: q/k/v conv pieces,
    per-expert w1 / w3 / w2), with a tokenizer."""
    from tests.engine.conftest import _write_tokenizer
    from tests.models.hf_tiny import make_hf_model

    path = str(tmp_path_factory.mktemp("tp_hf_tiny"))
    make_hf_model(seed=0).save_pretrained(path)
    _write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def k3_tp_dir(tmp_path_factory) -> str:
    """kimi-k3-tiny with moe_intermediate_size 64 (32 per rank at TP=2: one MXFP4 scale group);
    its checkpoint in the K3 scheme with MXFP4 experts, as make-model writes it."""
    from safetensors.torch import save_file

    from kdaserve.config.model_args import KimiLinearArgs
    from kdaserve.models import make_k3
    from kdaserve.models.make_model import make_model

    path = make_model(str(tmp_path_factory.mktemp("tp_k3")), preset="kimi-k3-tiny")
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["text_config"]["moe_intermediate_size"] = 64
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    save_file(make_k3.k3_checkpoint(KimiLinearArgs.from_hf_config(cfg), 0),
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_llm(model: str, prompts: list[list[int]], params, **kwargs):
    """(token ids, logprob dicts) per prompt from a fresh LLM; its pools must end free and its
    other ranks are shut down before it returns."""
    from kdaserve import LLM
    from tests.engine.conftest import assert_pools_free

    kwargs.setdefault("max_model_len", 512)
    kwargs.setdefault("num_gpu_blocks", 256)
    kwargs.setdefault("max_num_batched_tokens", 512)
    llm = LLM(model, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_pools_free(llm.llm_engine)
        return ([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
                llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


def close_logprobs(a, b, tol=1e-4) -> bool:
    """The chosen tokens' logprobs agree (the ranks' partial sums add in another order)."""
    for ra, rb in zip(a, b):
        for pa, pb in zip(ra, rb):
            for tok, lp in pa.items():
                if tok in pb and not math.isclose(lp.logprob, pb[tok].logprob, abs_tol=tol):
                    return False
    return True
