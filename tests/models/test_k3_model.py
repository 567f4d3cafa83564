"""kimi-k3-tiny through kdaserve's flattened-batch CPU path (prefill chunks and decode steps of
several requests in one batch) equals the per-sequence fp32 reference written from kimi_k3.md
(tests/models/k3_reference.py), within 1e-4."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file

from kdaserve.config import LoadConfig, ModelConfig
from kdaserve.models.loader import load_weights
from kdaserve.models.registry import build_model, resolve_architecture
from tests.models.k3_reference import K3Reference
from tests.models.k3_tiny import k3_tiny_dir, one_torch_thread  # noqa: F401
from tests.models.test_parity_hf import Runner, rel


@pytest.fixture(scope="module")
def k3(k3_tiny_dir):  # noqa: F811
    mc = ModelConfig(k3_tiny_dir)
    model = build_model(mc.arch, torch.float32, "cpu", resolve_architecture(mc.hf_config))
    load_weights(model, k3_tiny_dir, LoadConfig())
    with open(os.path.join(k3_tiny_dir, "config.json")) as f:
        text_cfg = json.load(f)["text_config"]
    ref = K3Reference(load_file(os.path.join(k3_tiny_dir, "model.safetensors")), text_cfg)
    return model, mc.arch, ref


def test_config_has_every_k3_piece(k3):
    _, args, _ = k3
    assert args.model_type == "kimi_k3" and args.expert_quantization == "mxfp4"
    assert args.kda_full_rank_gate and args.gate_lower_bound == -5.0
    assert args.q_lora_rank and args.mla_use_output_gate
    assert args.attn_res_block_size and args.num_attn_res_blocks == 3
    assert args.hidden_act == "situ" and args.is_latent_moe and args.latent_moe_use_norm
    assert args.num_shared_experts == 2 and args.num_nextn_predict_layers == 1
    assert args.mlp_layer_types[0] == "dense" and "sparse" in args.mlp_layer_types
    assert set(args.layer_types) == {"linear_attention", "full_attention"}


def test_flattened_batch_equals_per_sequence_reference(k3):
    model, args, ref = k3
    rng = random.Random(0)
    vocab = args.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (9, 37, 25)]
    extra = [[rng.randrange(vocab) for _ in range(4)] for _ in prompts]
    # per step: (request, number of new tokens); a request's tokens are its prompt then extra
    steps = [[(0, 9), (1, 20), (2, 7)],
             [(0, 1), (1, 17), (2, 9)],
             [(0, 1), (1, 1), (2, 9)],
             [(0, 1), (1, 1), (2, 1)],
             [(2, 1), (0, 1)]]
    seqs = [p + e for p, e in zip(prompts, extra)]
    want = [ref.logits(s) for s in seqs]
    runner = Runner(model, args, len(prompts))
    done = [0] * len(prompts)
    worst = 0.0
    for step in steps:
        out = runner.step([(r, seqs[r][done[r]:done[r] + n], done[r]) for r, n in step])
        for r, n in step:
            got, exp = out[r], want[r][done[r]:done[r] + n]
            worst = max(worst, rel(got, exp), (got - exp).abs().max().item())
            done[r] += n
    assert worst <= 1e-4, worst


def test_mxfp4_experts_stay_packed(k3):
    model, _, _ = k3
    packed = [(n, b) for n, b in model.named_buffers() if n.endswith("_packed")]
    assert packed and all(b.dtype == torch.uint8 for _, b in packed)
    assert not any("experts.gate_up_proj" == n.rsplit(".", 1)[-1] for n, _ in
                   model.named_parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fused_tail", [True, False])
def test_cuda_bf16_path_matches_the_cpu_reference(k3, k3_tiny_dir, fused_tail):  # noqa: F811
    """The CUDA kernels (KDA with the bounded full-rank gate, MLA, the MXFP4 latent MoE with
    its fused tail or the unfused baseline) in bf16 against the CPU fp32 model."""
    import dataclasses

    from kdaserve.config import KernelConfig
    from kdaserve.layers.backends import select_backends

    model, args, _ = k3
    mc = ModelConfig(k3_tiny_dir)
    kc = dataclasses.replace(KernelConfig(), latent_moe_fused_tail=fused_tail)
    gpu = build_model(mc.arch, torch.bfloat16, "cuda", resolve_architecture(mc.hf_config),
                      select_backends(kc, "cuda"))
    load_weights(gpu, k3_tiny_dir, LoadConfig())
    reqs = [(0, list(range(5, 60)), 0), (1, list(range(100, 117)), 0)]
    want = Runner(model, args, 2).step(reqs)
    got = Runner(gpu, args, 2, dtype=torch.bfloat16, device="cuda").step(reqs)
    for r in want:
        assert rel(got[r].float(), want[r]) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k3_fused_ops", [True, False])
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_decode_steps_match_the_cpu_reference(k3, k3_tiny_dir, k3_fused_ops,  # noqa: F811
                                                   pdl):
    """Decode steps on CUDA in bf16 (the one-launch KDA decode with the bounded full-rank
    gate, the SiTU GEMVs, and with k3_fused_ops the AttnRes / gate kernels; pdl: launched with
    programmatic dependent launch as inside the graphs) against the CPU fp32 model."""
    import dataclasses

    from kdaserve.config import KernelConfig
    from kdaserve.layers.backends import select_backends

    model, args, _ = k3
    mc = ModelConfig(k3_tiny_dir)
    kc = dataclasses.replace(KernelConfig(), k3_fused_ops=k3_fused_ops)
    gpu = build_model(mc.arch, torch.bfloat16, "cuda", resolve_architecture(mc.hf_config),
                      select_backends(kc, "cuda"))
    load_weights(gpu, k3_tiny_dir, LoadConfig())
    cpu_run, gpu_run = Runner(model, args, 2), Runner(gpu, args, 2, dtype=torch.bfloat16,
                                                      device="cuda", pdl=pdl)
    prompts = [list(range(5, 40)), list(range(100, 117))]
    steps = [[(0, prompts[0], 0), (1, prompts[1], 0)]]
    for t in range(4):
        steps.append([(0, [7 + t], len(prompts[0]) + t), (1, [60 + t], len(prompts[1]) + t)])
    for reqs in steps:
        want, got = cpu_run.step(reqs), gpu_run.step(reqs)
        for r in want:
            assert rel(got[r].float(), want[r]) <= 2e-2, (reqs[0][2], r)
