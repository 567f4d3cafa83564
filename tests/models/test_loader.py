"""Weight loader: both checkpoint naming schemes, sharding, malformed checkpoints, dummy init.

The model under load is transformers' KimiLinearForCausalLM, which has the parameter names and
shapes kdaserve's model keeps (the loader's contract)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from kdaserve.config import LoadConfig
from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.models.loader import (FP32_SUFFIXES, expected_tensors, load_weights,
                                    map_checkpoint_name)

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

TINY = dict(
    model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], vocab_size=96,
    hidden_size=32, num_hidden_layers=4,
    linear_attn_config=dict(head_dim=8, num_heads=2, short_conv_kernel_size=4,
                            kda_layers=[1, 2, 4], full_attn_layers=[3]),
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48, moe_intermediate_size=16,
    num_experts=4, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)


def new_model(dtype=torch.float32, seed: int | None = None) -> KimiLinearForCausalLM:
    if seed is not None:
        torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**TINY)).eval()
    if dtype != torch.float32:  # as kdaserve builds it: model dtype, fp32 where kept in fp32
        for name, t in model.state_dict(keep_vars=True).items():
            if not name.endswith(FP32_SUFFIXES):
                t.data = t.data.to(dtype)
    return model


def zero_all(model) -> None:
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            t.data.fill_(float("nan"))


def assert_same(model, ref_sd) -> None:
    sd = model.state_dict()
    assert set(sd) == set(ref_sd)
    for name, t in sd.items():
        want = ref_sd[name].to(t.dtype)
        assert t.shape == want.shape, name
        assert torch.equal(t, want), f"{name} differs after loading"


def fused_to_moonshot(sd: dict[str, torch.Tensor], a_log_flat: bool = False
                      ) -> dict[str, torch.Tensor]:
    """Rewrite a transformers>=5.17 state dict in Moonshot's original checkpoint names."""
    out = {}
    for name, t in sd.items():
        if name.endswith("self_attn.conv1d.weight"):
            p = name[: -len("conv1d.weight")]
            for prefix, piece in zip("qkv", t.chunk(3, dim=0)):
                out[f"{p}{prefix}_conv1d.weight"] = piece.clone()
            continue
        if ".self_attn.forget_gate." in name:
            name = name.replace(".forget_gate.", ".")
            if a_log_flat and name.endswith("A_log"):
                t = t.reshape(-1)
        if ".mlp.experts." in name or ".mlp.gate." in name or ".mlp.shared_experts." in name:
            name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("experts.gate_up_proj"):
            p = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}{e}.w1.weight"] = t[e, :inter].clone()
                out[f"{p}{e}.w3.weight"] = t[e, inter:].clone()
            continue
        if name.endswith("experts.down_proj"):
            p = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{p}{e}.w2.weight"] = t[e].clone()
            continue
        out[name] = t.clone()
    return out


def write_ckpt(path, tensors: dict[str, torch.Tensor], num_shards: int = 1) -> str:
    os.makedirs(path, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if num_shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return str(path)
    names = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::num_shards]}
        save_file(part, os.path.join(path, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(path)


@pytest.fixture(scope="module")
def ref_sd():
    return {k: v.clone() for k, v in new_model(seed=1).state_dict().items()}


# ---------------------------------------------------------------------------------------------

def test_expected_tensors_match_transformers():
    args = KimiLinearArgs.from_hf_config(TINY)
    exp = expected_tensors(args, torch.bfloat16)
    sd = new_model().state_dict()
    assert sorted(exp) == sorted(sd)
    for name, (shape, dtype) in exp.items():
        assert tuple(sd[name].shape) == shape, name
        assert dtype == (torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16), name


def test_name_mapping():
    t = map_checkpoint_name("model.layers.3.block_sparse_moe.experts.5.w3.weight")
    assert (t.param_name, t.piece) == ("model.layers.3.mlp.experts.gate_up_proj",
                                       ("expert_rows", 5, 1, 2))
    t = map_checkpoint_name("model.layers.0.self_attn.k_conv1d.weight")
    assert (t.param_name, t.piece) == ("model.layers.0.self_attn.conv1d.weight", ("rows", 1, 3))
    t = map_checkpoint_name("model.layers.2.self_attn.A_log")
    assert t.param_name == "model.layers.2.self_attn.forget_gate.A_log" and t.piece == ()
    assert map_checkpoint_name("lm_head.weight").param_name == "lm_head.weight"


def test_load_save_pretrained_checkpoint(tmp_path, ref_sd):
    src = new_model(seed=1)
    src.save_pretrained(tmp_path)  # transformers writes Moonshot's names back out
    model = new_model(seed=2)
    load_weights(model, str(tmp_path), LoadConfig())
    assert_same(model, ref_sd)


def test_load_fused_names(tmp_path, ref_sd):
    path = write_ckpt(tmp_path / "fused", ref_sd)
    model = new_model(seed=2)
    zero_all(model)
    load_weights(model, path, LoadConfig(load_format="safetensors"))
    assert_same(model, ref_sd)


def test_load_moonshot_names(tmp_path, ref_sd):
    path = write_ckpt(tmp_path / "moonshot", fused_to_moonshot(ref_sd, a_log_flat=True))
    model = new_model(seed=2)
    zero_all(model)
    load_weights(model, path, LoadConfig())
    assert_same(model, ref_sd)


def test_load_without_model_prefix(tmp_path, ref_sd):
    sd = {k.removeprefix("model."): v for k, v in ref_sd.items()}
    model = new_model(seed=2)
    load_weights(model, write_ckpt(tmp_path, sd), LoadConfig())
    assert_same(model, ref_sd)


def test_load_sharded(tmp_path, ref_sd):
    path = write_ckpt(tmp_path, fused_to_moonshot(ref_sd), num_shards=3)
    model = new_model(seed=2)
    zero_all(model)
    load_weights(model, path, LoadConfig())
    assert_same(model, ref_sd)


def test_load_casts_to_param_dtype(tmp_path, ref_sd):
    model = new_model(torch.bfloat16, seed=2)
    load_weights(model, write_ckpt(tmp_path, fused_to_moonshot(ref_sd)), LoadConfig())
    sd = model.state_dict()
    assert sd["model.layers.0.self_attn.forget_gate.dt_bias"].dtype == torch.float32
    assert sd["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert sd["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    assert_same(model, ref_sd)  # compares against the reference cast to each param's dtype


def test_process_weights_after_loading_called(tmp_path, ref_sd):
    model = new_model()
    calls = []
    model.process_weights_after_loading = lambda: calls.append(1)
    load_weights(model, write_ckpt(tmp_path, ref_sd), LoadConfig())
    load_weights(model, "", LoadConfig(load_format="dummy"))
    assert calls == [1, 1]


# --- malformed checkpoints ---------------------------------------------------------------------

def test_unknown_tensor(tmp_path, ref_sd):
    sd = dict(ref_sd)
    sd["model.layers.1.self_attn.bogus.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.bogus\.weight"):
        load_weights(new_model(), write_ckpt(tmp_path, sd), LoadConfig())


def test_missing_tensor(tmp_path, ref_sd):
    sd = fused_to_moonshot(ref_sd)
    del sd["model.layers.2.block_sparse_moe.experts.3.w3.weight"]  # half of one expert's rows
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.gate_up_proj"):
        load_weights(new_model(), write_ckpt(tmp_path, sd), LoadConfig())


def test_missing_whole_tensor(tmp_path, ref_sd):
    sd = dict(ref_sd)
    del sd["model.norm.weight"]
    with pytest.raises(ValueError, match=r"unloaded: model\.norm\.weight"):
        load_weights(new_model(), write_ckpt(tmp_path, sd), LoadConfig())


def test_shape_mismatch(tmp_path, ref_sd):
    sd = fused_to_moonshot(ref_sd)
    sd["model.layers.0.self_attn.q_conv1d.weight"] = torch.zeros(16, 1, 3)
    with pytest.raises(ValueError) as e:
        load_weights(new_model(), write_ckpt(tmp_path, sd), LoadConfig())
    msg = str(e.value)
    assert "model.layers.0.self_attn.q_conv1d.weight" in msg
    assert "(16, 1, 3)" in msg and "(16, 1, 4)" in msg


def test_duplicate_piece(tmp_path, ref_sd):
    sd = fused_to_moonshot(ref_sd)
    sd["layers.0.input_layernorm.weight"] = sd["model.layers.0.input_layernorm.weight"].clone()
    with pytest.raises(ValueError, match="second time"):
        load_weights(new_model(), write_ckpt(tmp_path, sd), LoadConfig())


def test_missing_shard(tmp_path, ref_sd):
    path = write_ckpt(tmp_path, ref_sd, num_shards=2)
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        load_weights(new_model(), path, LoadConfig())


def test_no_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_weights(new_model(), str(tmp_path), LoadConfig())
    with pytest.raises(ValueError, match="not a directory"):
        load_weights(new_model(), str(tmp_path / "nope"), LoadConfig())


# --- dummy weights -----------------------------------------------------------------------------

def dummy(seed=0, routing="vllm", dtype=torch.float32):
    model = new_model(dtype)
    zero_all(model)
    load_weights(model, "", LoadConfig(load_format="dummy", seed=seed, dummy_routing=routing))
    return model


def test_dummy_deterministic_and_in_range():
    a, b, c = dummy(0).state_dict(), dummy(0).state_dict(), dummy(1).state_dict()
    for name, t in a.items():
        assert torch.equal(t, b[name]), name
        assert not torch.equal(t, c[name]), name
        assert t.abs().max() <= 1e-3 and t.abs().max() > 1e-4, name
    # tensors of equal shape get different values (per-name streams)
    assert not torch.equal(a["model.layers.1.mlp.experts.gate_up_proj"],
                           a["model.layers.2.mlp.experts.gate_up_proj"])


def test_dummy_spread_router():
    sd = dummy(0, "spread").state_dict()
    base = dummy(0).state_dict()
    gate = sd["model.layers.1.mlp.gate.weight"]
    assert 0.01 < gate.std() < 0.03
    assert torch.count_nonzero(sd["model.layers.1.mlp.gate.e_score_correction_bias"]) == 0
    assert torch.equal(sd["model.layers.1.mlp.experts.down_proj"],
                       base["model.layers.1.mlp.experts.down_proj"])


def routed_experts(model, input_ids) -> list[torch.Tensor]:
    """Per MoE layer: [num_tokens, top_k] expert ids, sorted per token."""
    picks = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: picks.append(out[2].sort(-1).values))
             for name, m in model.named_modules() if name.endswith("mlp.gate")]
    with torch.no_grad():
        model(input_ids)
    for h in hooks:
        h.remove()
    return picks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_routing_modes_and_finite_logits(dtype):
    ids = torch.arange(3, 3 + 24).view(1, -1)
    for routing in ("vllm", "spread"):
        model = dummy(0, routing, dtype)
        with torch.no_grad():
            logits = model(ids).logits
        assert torch.isfinite(logits).all()
        picks = routed_experts(model, ids)
        assert len(picks) == 3
        distinct = [len({tuple(row.tolist()) for row in p}) for p in picks]
        if routing == "vllm":
            assert distinct == [1, 1, 1], distinct  # every token -> the same experts
        else:
            assert min(distinct) > 1, distinct


def test_dummy_rejects_bad_routing():
    from kdaserve.models.loader import init_dummy_weights

    with pytest.raises(ValueError, match="bogus"):
        init_dummy_weights(new_model(), 0, "bogus")
