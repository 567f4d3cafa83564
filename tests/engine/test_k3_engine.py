"""The offline engine on kimi-k3-tiny (CPU, fp32): batching, chunked prefill and preemption never
change greedy output, and the output is the greedy continuation of the reference logits."""

from __future__ import annotations

import json
import os
import random

import torch
from safetensors.torch import load_file

from kdaserve import SamplingParams
from tests.models.k3_tiny import k3_tiny_dir, make_k3_llm, one_torch_thread  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 3000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def generate(llm, ps, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_batch_chunking_and_preemption_keep_greedy_output(make_k3_llm):  # noqa: F811
    ps = prompts(6, lo=30, hi=60)
    batched = generate(make_k3_llm(), ps)
    assert batched == [generate(make_k3_llm(), [p])[0] for p in ps[:2]] + batched[2:]
    assert generate(make_k3_llm(max_num_batched_tokens=13), ps) == batched
    small = make_k3_llm(num_gpu_blocks=12, max_model_len=160)
    assert generate(small, ps) == batched
    assert small.llm_engine.scheduler.get_stats().num_preemptions > 0


def test_greedy_follows_the_reference_model(make_k3_llm, k3_tiny_dir):  # noqa: F811
    from tests.models.k3_reference import K3Reference

    with open(os.path.join(k3_tiny_dir, "config.json")) as f:
        ref = K3Reference(load_file(os.path.join(k3_tiny_dir, "model.safetensors")),
                          json.load(f)["text_config"])
    p = prompts(1, seed=3, lo=20, hi=20)[0]
    out = generate(make_k3_llm(), [p], SamplingParams(temperature=0.0, max_tokens=5,
                                                      ignore_eos=True))[0]
    seq = p + out
    logits = ref.logits(seq[:-1])[len(p) - 1:]
    vocab = len(make_k3_llm().llm_engine.tokenizer)
    # ties aside, each generated token is the reference argmax (over the tokenizer's ids)
    top2 = logits[:, :vocab].topk(2).values
    for t, tok in enumerate(out):
        if top2[t, 0] - top2[t, 1] > 1e-4:
            assert tok == int(logits[t].argmax()), t
    assert torch.isfinite(logits).all()


def test_step_floor_counts_mxfp4_expert_bytes(make_k3_llm):  # noqa: F811
    from kdaserve.engine.floor import weight_bytes
    from kdaserve.kernels.mxfp4.format import packed_bytes

    llm = make_k3_llm()
    model, args = llm.llm_engine.model_runner.model, llm.llm_engine.model_runner.args
    dense, per_expert, moe_layers = weight_bytes(model)
    inter, lat = args.moe_intermediate_size, args.expert_input_size
    assert per_expert == packed_bytes(2 * inter, lat) + packed_bytes(lat, inter)
    assert moe_layers == args.mlp_layer_types.count("sparse")
    params = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                 if "embed_tokens" not in n)
    assert dense == params          # every parameter is non-expert; experts are buffers
    floor = llm.llm_engine.step_floor
    assert floor.per_expert_bytes == per_expert and floor.seconds(4, 400) > 0
