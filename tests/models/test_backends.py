"""Kernel backends: each switch of the kernel config picks one backend per layer kind, once at
start-up, and the layers keep what the model was built with (no flag changes afterwards)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kdaserve.attention.forward_context import ExecMode, StepPlan
from kdaserve.attention.builder import build_metadata
from kdaserve.config import KernelConfig
from kdaserve.layers.backends import LayerBackends, select_backends
from kdaserve.layers.kda import KimiDeltaAttention
from kdaserve.layers.mla import MLAttention
from kdaserve.layers.moe import Experts
from kdaserve.layers.mlp import MLP
from kdaserve.models.kimi_linear import KimiLinearForCausalLM


def test_cpu_is_the_reference_set_whatever_the_switches():
    assert select_backends(KernelConfig(), "cpu") == LayerBackends()
    assert select_backends(KernelConfig.baseline(), "cpu") == LayerBackends()


def test_each_switch_picks_its_cuda_backend():
    on = select_backends(KernelConfig(), "cuda")
    assert (on.linear, on.dense_mlp, on.kda, on.mla, on.moe, on.sampler) == (
        "gemv_skinny", "gemv_swiglu", "fla_fused_decode", "triton_absorb_gemv", "triton",
        "threshold")
    assert on.gemv and on.skinny and on.kda_state_prefetch
    off = select_backends(KernelConfig.baseline(), "cuda")
    assert (off.linear, off.dense_mlp, off.kda, off.mla, off.moe, off.sampler) == (
        "torch", "torch", "fla", "triton", "triton", "sort")
    assert not off.kda_state_prefetch
    # the skinny GEMM and the swiglu GEMV need the GEMV projections; the state prefetch the
    # fused decode
    kc = dataclasses.replace(KernelConfig(), skinny_gemm=False)
    assert select_backends(kc, "cuda").linear == "gemv"
    assert not select_backends(kc, "cuda").skinny
    kc = dataclasses.replace(KernelConfig(), decode_gemv=False)
    assert select_backends(kc, "cuda").dense_mlp == "torch"
    assert select_backends(kc, "cuda").linear == "torch"
    kc = dataclasses.replace(KernelConfig(), fused_kda_decode=False)
    assert not select_backends(kc, "cuda").kda_state_prefetch


def test_unknown_backend_names_are_refused():
    with pytest.raises(ValueError, match="kda"):
        LayerBackends(kda="fused")
    with pytest.raises(ValueError, match="gemv_swiglu"):
        LayerBackends(dense_mlp="gemv_swiglu")


def test_layers_take_the_backends_they_are_built_with():
    import copy

    from kdaserve.config.model_args import KimiLinearArgs
    from kdaserve.models import make_model

    cfg = make_model.base_config()
    cfg.update(copy.deepcopy(make_model._PRESET_ARCH["tiny"]), vocab_size=64)
    args = KimiLinearArgs.from_hf_config(cfg)
    for kc in (KernelConfig(), KernelConfig.baseline(), KernelConfig(mla_verify_fold=True),
               KernelConfig(moe_tma_weights=True)):
        backends = select_backends(kc, "cuda")
        with torch.device("meta"):
            model = KimiLinearForCausalLM(args, backends)
        assert model.backends is backends
        kda = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
        mla = [m for m in model.modules() if isinstance(m, MLAttention)]
        mlps = [m for m in model.modules() if isinstance(m, MLP)]
        assert kda and mla and mlps
        assert all(m.fused_decode == kc.fused_kda_decode and m.gemv == kc.decode_gemv
                   for m in kda)
        assert all(m.absorb_gemv == kc.mla_absorb_gemv for m in mla)
        assert all(m.verify_fold == kc.mla_verify_fold for m in mla)
        experts = [m for m in model.modules() if isinstance(m, Experts)]
        assert experts and all(m.tma_weights == kc.moe_tma_weights for m in experts)
        assert all(m.act_gemv == (kc.decode_gemv and kc.dense_mlp_gemv) for m in mlps)


def test_the_eager_plan_follows_the_batch():
    """Decode-only (the one-launch KDA decode applies), mixed, prefill-only, and exports."""
    dec = build_metadata([1, 1], [4, 9], [[0], [1]], [0, 1], 16, "cpu")
    assert StepPlan.eager(dec) == StepPlan(ExecMode.EAGER, pdl=False, decode_only=True)
    mixed = build_metadata([1, 5], [4, 0], [[0], [1]], [0, 1], 16, "cpu")
    assert StepPlan.eager(mixed) == StepPlan(ExecMode.MIXED, decode_only=False)
    pre = build_metadata([5], [0], [[0]], [0], 16, "cpu")
    assert StepPlan.eager(pre) == StepPlan(ExecMode.EAGER, decode_only=False)
    assert StepPlan.eager_for(2, 0, 0, exports=True).decode_only is False
    assert StepPlan.eager_for(0, 3, 0, exports=False).mode is ExecMode.EAGER
    assert StepPlan.eager_for(1, 3, 0, exports=False).mode is ExecMode.MIXED


def test_latent_moe_switch_picks_the_fused_tail():
    from kdaserve.layers.latent_moe import LatentMoE
    from kdaserve.models.make_model import preset_args

    assert select_backends(KernelConfig(), "cuda").latent_moe == "fused_tail"
    assert select_backends(KernelConfig.baseline(), "cuda").latent_moe == "unfused"
    args = preset_args("kimi-k3-tiny")
    with torch.device("meta"):
        on = LatentMoE(args, select_backends(KernelConfig(), "cuda"))
        off = LatentMoE(args, select_backends(KernelConfig.baseline(), "cuda"))
    assert on.fused_tail and not off.fused_tail


def test_k3_fused_ops_switch_picks_the_k3_kernels():
    """k3_fused_ops: the AttnRes reads, SiTU and the K3 gates of a kimi-k3-tiny built for CUDA
    take their Triton kernels; off (and on the CPU) their twins."""
    from kdaserve.layers.kda import ForgetGate
    from kdaserve.models.kimi_linear import DecoderLayer, KimiLinearModel
    from kdaserve.models.make_model import preset_args

    args = preset_args("kimi-k3-tiny")
    off = dataclasses.replace(KernelConfig(), k3_fused_ops=False)
    for kc, device, on in ((KernelConfig(), "cuda", True), (off, "cuda", False),
                           (KernelConfig(), "cpu", False)):
        backends = select_backends(kc, device)
        assert (backends.attn_res, backends.gated_act, backends.k3_gates) == (
            ("triton",) * 3 if on else ("reference",) * 3)
        with torch.device("meta"):
            model = KimiLinearForCausalLM(args, backends)
        reads = [m for m in model.modules() if isinstance(m, (DecoderLayer, KimiLinearModel))]
        situ = [m for m in model.modules() if isinstance(m, MLP)]
        mla = [m for m in model.modules() if isinstance(m, MLAttention)]
        gates = [m for m in model.modules() if isinstance(m, ForgetGate)]
        assert reads and situ and mla and gates
        assert all(m.attn_res_kernel == on for m in reads)
        assert all(m.situ_kernel == on for m in situ) and all(m.gate_kernel == on for m in mla)
        assert all(m.kernel == on for m in gates)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
@pytest.mark.parametrize("fused_tail", [True, False])
def test_latent_moe_backends_on_gpu(experts, fused_tail):
    """The latent MoE layer on CUDA in bf16 (fused_tail: the Triton expert GEMMs + tail launch;
    unfused: the experts, then the top-k sum, norm and up projection as separate ops), MXFP4
    or bf16 experts, against the CPU reference layer in fp32 on the same weights."""
    from kdaserve.kernels.mxfp4.format import quantize_mxfp4
    from kdaserve.layers.latent_moe import LatentMoE
    from kdaserve.models.make_model import preset_args

    args = dataclasses.replace(preset_args("kimi-k3-tiny"), hidden_size=256,
                               routed_expert_hidden_size=128, moe_intermediate_size=64,
                               num_experts=16, num_experts_per_token=4,
                               expert_quantization=None if experts == "bf16" else "mxfp4")
    gen = torch.Generator().manual_seed(0)
    ref = LatentMoE(args)
    for name, t in ref.named_parameters():
        t.data.copy_(torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5 if t.dim() > 1
                     else 1 + 0.1 * torch.randn(t.shape, generator=gen))
    for name, t in ref.named_buffers():
        t.copy_(0.1 * torch.randn(t.shape, generator=gen) if t.is_floating_point() else t)
    if experts == "mxfp4":
        for w in ("gate_up_proj", "down_proj"):
            dense = torch.randn(getattr(ref.experts, w + "_packed").shape[:-1]
                                + (getattr(ref.experts, w + "_packed").shape[-1] * 2,),
                                generator=gen)
            p, s = quantize_mxfp4(dense / dense.shape[-1] ** 0.5)
            getattr(ref.experts, w + "_packed").copy_(p)
            getattr(ref.experts, w + "_scale").copy_(s)
    kc = dataclasses.replace(KernelConfig(), latent_moe_fused_tail=fused_tail)
    gpu = LatentMoE(args, select_backends(kc, "cuda"))
    gpu.load_state_dict(ref.state_dict())
    gpu = gpu.to("cuda")
    for n, t in gpu.named_parameters():          # bf16 like the model; the router stays fp32
        if n != "gate.weight":
            t.data = t.data.to(torch.bfloat16)
    for layer in (ref, gpu):
        for mod in layer.modules():
            if mod is not layer and hasattr(mod, "process_weights_after_loading"):
                mod.process_weights_after_loading()
    for N in (1, 5, 33):
        x = torch.randn(N, args.hidden_size, generator=gen)
        want = ref(x)
        got = gpu(x.to("cuda", torch.bfloat16)).float().cpu()
        err = ((got - want).norm() / want.norm()).item()
        assert err <= 1e-2, (N, err)


def test_tma_weights_only_for_16_byte_rows():
    """KernelConfig.moe_tma_weights reaches experts whose bf16 rows (hidden and this rank's
    intermediate width) are whole 16-byte units; others, and MXFP4 experts, keep pointer
    tiles instead of failing at their first prefill."""
    with torch.device("meta"):
        assert Experts(4, 64, 32, tma_weights=True).tma_weights
        assert not Experts(4, 64, 32, tma_weights=False).tma_weights
        assert not Experts(4, 64, 12, tma_weights=True).tma_weights        # 24-byte rows
        assert not Experts(4, 60, 32, tma_weights=True).tma_weights
        assert not Experts(4, 64, 32, quant="mxfp4", tma_weights=True).tma_weights


@pytest.mark.parametrize("capability,kept", [((8, 0), False), ((9, 0), True)])
def test_hopper_switches_follow_the_device(monkeypatch, capability, kept):
    """PDL and the MoE's TMA weight tiles are dropped below compute capability 9.0, once at
    start-up; the other switches stay as asked."""
    from kdaserve.worker.worker import supported_kernels

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    kc = supported_kernels(KernelConfig(), torch.device("cuda"))
    assert (kc.pdl, kc.moe_tma_weights) == (kept, kept)
    assert dataclasses.replace(kc, pdl=True, moe_tma_weights=True) == KernelConfig()
    assert supported_kernels(KernelConfig(), torch.device("cpu")) == KernelConfig()
