"""A tiny transformers KimiLinear model, the CPU ground truth for parity tests."""

from __future__ import annotations

import torch

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
    num_experts_per_token=2, num_shared_experts=1, routed_scaling_factor=2.446,
    first_k_dense_replace=1, rms_norm_eps=1e-5, tie_word_embeddings=False,
    linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                        "kda_layers": [1, 2, 4, 5], "full_attn_layers": [3]},
    mla_use_nope=True, model_max_length=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def make_hf_model(seed: int = 0, **overrides):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    cfg = KimiLinearConfig(**{**TINY, **overrides})
    model = KimiLinearForCausalLM(cfg).eval().float()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:   # exercise the selection-only bias
                gate.e_score_correction_bias.normal_(0, 0.05)
    return model
