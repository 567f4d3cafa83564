"""Loading Kimi K3: the K3 name scheme (language_model. prefix, Moonshot names, compressed-tensors
MXFP4 experts, MTP and vision tensors skipped), the model's own (fused) names, bf16 experts
quantised at load (--quantization mxfp4), dummy weights packed to MXFP4, fastsafetensors; the
config parsing of kimi_k3 and of Kimi-Linear configs with K3 fields."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kdaserve.config import LoadConfig, ModelConfig
from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.kernels.mxfp4.format import dequantize_mxfp4, quantize_mxfp4
from kdaserve.models import make_k3
from kdaserve.models.loader import expected_tensors, load_weights
from kdaserve.models.registry import build_model, resolve_architecture
from tests.models.k3_tiny import k3_tiny_dir, one_torch_thread  # noqa: F401


def build(path: str, quantization: str | None = None, fmt: str = "auto"):
    mc = ModelConfig(path, quantization=quantization)
    model = build_model(mc.arch, torch.float32, "cpu", resolve_architecture(mc.hf_config))
    load_weights(model, path, LoadConfig(load_format=fmt))
    return model


def ckpt(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def copy_folder(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def test_k3_scheme_fills_every_tensor_and_skips_mtp(k3_tiny_dir, caplog):  # noqa: F811
    with caplog.at_level(logging.INFO, logger="kdaserve.models.loader"):
        model = build(k3_tiny_dir)
    assert "MTP" in caplog.text
    sd = ckpt(k3_tiny_dir)
    buffers = dict(model.named_buffers())
    p = "model.layers.1.mlp.experts."
    inter = model.args.moe_intermediate_size
    for e in (0, 5):
        k3p = f"language_model.model.layers.1.block_sparse_moe.experts.{e}."
        assert torch.equal(buffers[p + "gate_up_proj_packed"][e, :inter], sd[k3p + "w1.weight_packed"])
        assert torch.equal(buffers[p + "gate_up_proj_packed"][e, inter:], sd[k3p + "w3.weight_packed"])
        assert torch.equal(buffers[p + "gate_up_proj_scale"][e, inter:], sd[k3p + "w3.weight_scale"])
        assert torch.equal(buffers[p + "down_proj_packed"][e], sd[k3p + "w2.weight_packed"])
        assert torch.equal(buffers[p + "down_proj_scale"][e], sd[k3p + "w2.weight_scale"])
    conv = dict(model.named_parameters())["model.layers.0.self_attn.conv1d.weight"]
    k_conv = sd["language_model.model.layers.0.self_attn.k_conv1d.weight"]
    assert torch.equal(conv[k_conv.shape[0]:2 * k_conv.shape[0]], k_conv.float())


def test_fused_names_round_trip(k3_tiny_dir, tmp_path):  # noqa: F811
    model = build(k3_tiny_dir)
    folder = copy_folder(k3_tiny_dir, tmp_path / "fused")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(folder, "model.safetensors"))
    again = build(folder)
    for name, t in again.state_dict().items():
        assert torch.equal(t, state[name]), name
    assert set(state) == set(expected_tensors(model.args))


def test_vision_tensors_are_skipped(k3_tiny_dir, tmp_path):  # noqa: F811
    folder = copy_folder(k3_tiny_dir, tmp_path / "vision")
    sd = ckpt(k3_tiny_dir)
    sd["vision_tower.patch_embed.weight"] = torch.zeros(4, 4)
    sd["mm_projector.linear_1.weight"] = torch.zeros(4, 4)
    save_file(sd, os.path.join(folder, "model.safetensors"))
    build(folder)


def _bf16_expert_folder(src: str, dst) -> str:
    """The tiny K3 checkpoint with model-dtype experts (experts.{e}.w{1,2,3}.weight) and no
    quantization_config."""
    folder = copy_folder(src, dst)
    sd = {}
    for name, t in ckpt(src).items():
        if name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            scale = ckpt(src)[name.removesuffix("_packed") + "_scale"]
            sd[name.removesuffix("_packed")] = dequantize_mxfp4(t, scale, torch.bfloat16)
        else:
            sd[name] = t
    save_file(sd, os.path.join(folder, "model.safetensors"))
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    del cfg["text_config"]["quantization_config"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return folder


def test_bf16_experts_quantised_at_load(k3_tiny_dir, tmp_path):  # noqa: F811
    folder = _bf16_expert_folder(k3_tiny_dir, tmp_path / "bf16")
    plain = build(folder)
    assert plain.args.expert_quantization is None
    assert "model.layers.1.mlp.experts.gate_up_proj" in dict(plain.named_parameters())
    quantised = build(folder, quantization="mxfp4")
    want = dict(build(k3_tiny_dir).named_buffers())
    got = dict(quantised.named_buffers())
    # the bf16 values are exactly the MXFP4 ones: quantising them gives the same bytes back
    for name in want:
        if name.endswith(("_packed", "_scale")):
            assert torch.equal(got[name], want[name]), name


def test_mxfp4_checkpoint_into_bf16_experts_is_refused(k3_tiny_dir):  # noqa: F811
    mc = ModelConfig(k3_tiny_dir)
    args = dataclasses.replace(mc.arch, expert_quantization=None)
    model = build_model(args, torch.float32, "cpu", resolve_architecture(mc.hf_config))
    with pytest.raises(ValueError, match="MXFP4"):
        load_weights(model, k3_tiny_dir, LoadConfig())


def test_dummy_packs_uniform_weights(k3_tiny_dir):  # noqa: F811
    a = dict(build(k3_tiny_dir, fmt="dummy").named_buffers())
    b = dict(build(k3_tiny_dir, fmt="dummy").named_buffers())
    name = "model.layers.2.mlp.experts.down_proj_packed"
    assert torch.equal(a[name], b[name])
    w = dequantize_mxfp4(a[name], a[name.replace("_packed", "_scale")])
    assert w.abs().max() <= 1e-3 and w.abs().max() > 5e-4 and (w != 0).float().mean() > 0.5
    # exactly the quantisation of the dummy weights of the same model with bf16 experts
    folder = k3_tiny_dir
    mc = ModelConfig(folder)
    plain = build_model(dataclasses.replace(mc.arch, expert_quantization=None), torch.float32,
                        "cpu", resolve_architecture(mc.hf_config))
    load_weights(plain, folder, LoadConfig(load_format="dummy"))
    dense = dict(plain.named_parameters())["model.layers.2.mlp.experts.down_proj"]
    p, s = quantize_mxfp4(dense.data)
    assert torch.equal(p, a[name]) and torch.equal(s, a[name.replace("_packed", "_scale")])


def test_fastsafetensors_falls_back_with_one_log_line(k3_tiny_dir, caplog):  # noqa: F811
    pytest.importorskip("safetensors")
    try:
        import fastsafetensors  # noqa: F401
        pytest.skip("fastsafetensors is installed: no fallback")
    except ImportError:
        pass
    with caplog.at_level(logging.INFO, logger="kdaserve.models.loader"):
        model = build(k3_tiny_dir, fmt="fastsafetensors")
    assert sum("fastsafetensors" in r.message for r in caplog.records) == 1
    ref = build(k3_tiny_dir)
    for (n, t), (_, u) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(t, u), n


# --- config -------------------------------------------------------------------------------------

def k3_cfg() -> dict:
    ids = dict(bos=0, eos=1, pad=2, media_pad=3)
    return make_k3.k3_config("kimi-k3-tiny", ids, 256)


def test_kimi_k3_config_parsing():
    args = KimiLinearArgs.from_hf_config(k3_cfg())
    assert args.model_type == "kimi_k3" and args.eos_token_id == [1]
    lifted = k3_cfg()
    lifted["quantization_config"] = lifted["text_config"].pop("quantization_config")
    assert KimiLinearArgs.from_hf_config(lifted).expert_quantization == "mxfp4"
    vllm = k3_cfg()
    vllm["text_config"]["quantization_config"] = {"quant_method": "mxfp4"}
    assert KimiLinearArgs.from_hf_config(vllm).expert_quantization == "mxfp4"
    full = make_k3.k3_config("kimi-k3", dict(bos=0, eos=1, pad=2, media_pad=3), 163840)
    big = KimiLinearArgs.from_hf_config(full)
    assert big.has_vision and big.num_attn_res_blocks == 8
    assert (big.hidden_size, big.num_experts, big.num_experts_per_token,
            big.routed_expert_hidden_size, big.moe_intermediate_size) == (7168, 896, 16, 3584, 3072)
    assert big.layer_types[-2:] == ["full_attention"] * 2
    assert all(big.layer_types[i] == "linear_attention" for i in range(0, 93, 12))


@pytest.mark.parametrize("change, match", [
    (lambda t: t.update(quantization_config={"quant_method": "fp8"}), "quantization"),
    (lambda t: t["linear_attn_config"].update(gate_lower_bound=-6.0), "gate_lower_bound"),
    (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
    (lambda t: t.update(routed_expert_hidden_size=48), "multiple of 32"),
    (lambda t: t.update(topk_method="greedy"), "topk_method"),
])
def test_bad_k3_configs_name_the_field(change, match):
    cfg = k3_cfg()
    change(cfg["text_config"])
    with pytest.raises(ValueError, match=match):
        KimiLinearArgs.from_hf_config(cfg)


def test_kimi_linear_config_with_k3_fields():
    """A kimi_linear config may carry any K3 field: the same model definition serves it."""
    from kdaserve.models.make_model import base_config, _PRESET_ARCH

    cfg = base_config()
    cfg.update(copy.deepcopy(_PRESET_ARCH["tiny"]))
    cfg.update(vocab_size=128, q_lora_rank=16, mla_use_output_gate=True, attn_res_block_size=3,
               hidden_act="situ", activation_situ_beta=4.0, moe_intermediate_size=32,
               quantization_config={"quant_method": "mxfp4"})
    cfg["linear_attn_config"].update(use_full_rank_gate=True, gate_lower_bound=-3.0)
    args = KimiLinearArgs.from_hf_config(cfg)
    model = build_model(args, torch.float32, "cpu")
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    assert shapes == {n: s for n, (s, _) in expected_tensors(args).items()}
    assert "model.layers.1.mlp.experts.gate_up_proj_packed" in shapes   # hidden-width MXFP4
    from kdaserve.models.loader import init_dummy_weights
    from tests.models.test_parity_hf import Runner

    init_dummy_weights(model, dummy_routing="spread")
    model.process_weights_after_loading()
    out = Runner(model, args, 2).step([(0, [5, 6, 7, 8], 0), (1, list(range(3, 40)), 0)])
    assert all(torch.isfinite(o).all() for o in out.values())


# --- presets -------------------------------------------------------------------------------------

def test_count_presets():
    import subprocess
    import sys

    from kdaserve.models.make_model import preset_args

    out = subprocess.run([sys.executable, "-m", "kdaserve.entrypoints.cli", "make-model",
                          "--preset", "kimi-k3", "--count"], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("kimi-k3: ") and "T parameters" in out.stdout, out.stdout
    full = make_k3.count(preset_args("kimi-k3"))
    # 92 MoE layers of 896 experts x 3 x 3584 x 3072 weights at 4.25 bits
    assert full["expert_params"] == 92 * 896 * 3 * 3584 * 3072
    assert full["expert_bytes"] == full["expert_params"] * 17 // 32
    mini_args = preset_args("kimi-k3-mini")
    mini = make_k3.count(mini_args)
    assert mini["expert_bytes"] > mini["bytes"] - mini["expert_bytes"]   # the MoE dominates
    assert mini["bytes"] < 40 * 2 ** 30          # one H200 with room for caches
    bf16 = make_k3.count(dataclasses.replace(mini_args, expert_quantization=None))
    # the bf16-expert baseline fits too, and with the MXFP4 twin (the KL measurement)
    assert bf16["bytes"] + bf16["mtp_bytes"] < 80 * 2 ** 30
    assert bf16["bytes"] + mini["bytes"] < 100 * 2 ** 30
    step = make_k3.step_bytes(mini_args)
    assert mini_args.num_experts_per_token == 16                       # K3's top-k
    assert step["active_expert_bytes_bf16"] > 4 * step["dense_bytes"]  # experts dominate a step
    assert step["active_expert_bytes_mxfp4"] == step["active_expert_bytes_bf16"] * 17 // 64
    assert step["floor_ratio"] >= 2.0            # room for the 1.55x MXFP4 / bf16 target
    assert step["step_bytes_bf16"] - step["step_bytes_mxfp4"] == (
        step["active_expert_bytes_bf16"] - step["active_expert_bytes_mxfp4"])
    out = subprocess.run([sys.executable, "-m", "kdaserve.entrypoints.cli", "make-model",
                          "--preset", "kimi-k3-mini", "--count"], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 3, out.stdout + out.stderr
    assert lines[1].startswith("kimi-k3-mini with bf16 experts: ")
    assert f"floor ratio bf16 / MXFP4 {step['floor_ratio']:.2f}x" in lines[2]


def test_config_only_presets(tmp_path):
    from kdaserve.models.make_model import make_model

    path = make_model(str(tmp_path / "k3"), preset="kimi-k3")
    assert not os.path.exists(os.path.join(path, "model.safetensors"))
    args = ModelConfig(path).arch
    assert args.num_hidden_layers == 93 and args.has_vision
