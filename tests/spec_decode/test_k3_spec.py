"""Speculative decoding on kimi-k3-tiny: n-gram and MTP (the checkpoint's own MTP layer, K3
name scheme, MXFP4 experts) greedy output equals greedy output without speculation, in both
KDA state modes (RecoverSSM, per-position), with spec rows, plain decodes and prefills in the
same steps; the MTP drafter's blocks are all free at the end."""

from __future__ import annotations

import random

import pytest
import torch

from kdaserve import SamplingParams
from tests.models.k3_tiny import k3_tiny_dir, make_k3_llm, one_torch_thread  # noqa: F401
from tests.spec_decode.test_engine_spec import _run



def _repeated(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 60) for _ in range(6)] * 2


# Seeds whose prompts (6 tokens, twice) lead the random tiny model into n-gram matches it
# then confirms (found by search): accepted drafts, not only rejections.
PROMPTS = [_repeated(7), list(range(100, 130)), _repeated(18), _repeated(33)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 20, 40,
                                                                                    40)]


@pytest.fixture(scope="module")
def plain(k3_tiny_dir):  # noqa: F811
    from kdaserve import LLM

    llm = LLM(k3_tiny_dir, max_model_len=512, num_gpu_blocks=256, max_num_batched_tokens=512)
    return _run(llm, PROMPTS, PARAMS)[0]


@pytest.mark.parametrize("state_mode", ["recover", "per_position"])
def test_ngram_greedy_equals_plain(make_k3_llm, plain, state_mode):  # noqa: F811
    llm = make_k3_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "kda_state_mode": state_mode})
    got, mixed = _run(llm, PROMPTS, PARAMS)
    assert got == plain
    assert mixed, "no step mixed spec rows with other rows"
    st = llm.llm_engine.spec_decoding_stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0, st.as_dict()


@pytest.mark.parametrize("state_mode", ["recover", "per_position"])
def test_mtp_greedy_equals_plain(make_k3_llm, plain, k3_tiny_dir, state_mode):  # noqa: F811
    from safetensors import safe_open

    llm = make_k3_llm(speculative_config={"method": "mtp", "num_speculative_tokens": 3,
                                          "kda_state_mode": state_mode})
    got, mixed = _run(llm, PROMPTS, PARAMS)
    assert got == plain
    assert mixed, "no step mixed spec rows with other rows"
    eng = llm.llm_engine
    assert eng.spec_decoding_stats.num_draft_tokens > 0
    drafter = eng.model_runner.spec.proposer
    n = eng.model_runner.args.num_hidden_layers
    with safe_open(f"{k3_tiny_dir}/model.safetensors", framework="pt") as f:   # K3 names
        want = f.get_tensor(f"language_model.model.layers.{n}.eh_proj.weight")
    assert torch.equal(drafter.model.layers[0].eh_proj.weight, want.float())
    if eng.scheduler.has_finished_requests():
        eng.step()
    assert not drafter.requests and drafter.num_free_blocks == drafter.num_blocks
