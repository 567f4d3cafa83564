"""The bf16 GPU path (fla-core KDA, Triton MLA decode / MoE / conv) vs the fp32 CPU reference."""

from __future__ import annotations

import pytest
import torch

from kdaserve.models.registry import build_model
from tests.models.test_parity_hf import EXTRA, PROMPTS, Runner, pair, rel, run_chunked  # noqa: F401

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def gpu_model(pair):
    _, ours, args = pair
    model = build_model(args, torch.bfloat16, "cuda")
    model.load_state_dict(ours.state_dict())
    model.process_weights_after_loading()
    return model, args


def test_bf16_gpu_one_batch_matches_cpu_reference(pair, gpu_model):
    _, ours, args = pair
    model, _ = gpu_model
    reqs = [(i, p, 0) for i, p in enumerate(PROMPTS)]
    ref = Runner(ours, args, len(PROMPTS)).step(reqs)
    got = Runner(model, args, len(PROMPTS), torch.bfloat16, "cuda").step(reqs)
    for i in range(len(PROMPTS)):
        assert rel(got[i], ref[i]) <= 2e-2, i


def test_bf16_gpu_chunked_and_decode_matches_cpu_reference(pair, gpu_model):
    _, ours, args = pair
    model, _ = gpu_model
    ref = run_chunked(Runner(ours, args, len(PROMPTS)), EXTRA)
    got = run_chunked(Runner(model, args, len(PROMPTS), torch.bfloat16, "cuda"), EXTRA)
    for i in range(len(PROMPTS)):
        assert rel(got[i], ref[i]) <= 2e-2, i


def test_gpu_engine_greedy_with_cuda_graphs(tmp_path):
    """The engine on CUDA (graphs on and off) generates the same greedy tokens."""
    from tests.engine.conftest import _write_tokenizer
    from tests.models.hf_tiny import make_hf_model

    from kdaserve import LLM, SamplingParams

    make_hf_model(seed=0).save_pretrained(str(tmp_path))
    _write_tokenizer(str(tmp_path))
    ps = [{"prompt_token_ids": p} for p in PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(tmp_path), max_model_len=512, max_num_seqs=8, num_gpu_blocks=128,
                  enforce_eager=eager, dtype="float32")
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        del llm
    assert outs[True] == outs[False]
