"""The Kimi K3 presets of `kdaserve make-model`: kimi-k3-tiny, kimi-k3-mini, kimi-k3.

A K3 folder is laid out as a real Kimi K3 checkpoint is: config.json of
`KimiK3ForConditionalGeneration` (model_type `kimi_k3`, the text model in `text_config`, its
routed experts declared compressed-tensors `mxfp4-pack-quantized`), the Kimi tokenizer layout
(`tiktoken.model` + `tokenizer_config.json`, no tokenizer.json) with the K3 chat template
(data/chat_template_k3.jinja), and for kimi-k3-tiny the weights in the K3 name scheme
(`language_model.` prefix, Moonshot's names, per-expert `w1/w3/w2.weight_packed|weight_scale`,
MTP layers after the last layer). kimi-k3-mini and kimi-k3 are config + tokenizer only (serve
them with `--load-format dummy`).

- kimi-k3-tiny: every K3 piece at CPU-test size (AttnRes over 3 blocks, KDA with the full-rank
  gate and the gate lower bound, MLA with q-LoRA and the output gate, SiTU, the latent MoE with
  its norm and 2 shared experts, MXFP4 experts, one MTP layer, a dense first layer).
- kimi-k3-mini: K3's shape scaled to one H200 with room for caches, with bf16 experts (the
  MXFP4 comparison's baseline) as well as MXFP4 ones; sized so the routed experts are the
  dominant byte cost of a batch-1 decode step, which is what MXFP4 can speed up: K3's top-16
  routing, experts wider than K3's proportions (latent = hidden = intermediate 2048), one
  shared expert, 12 layers, a 2x-hidden dense first layer. A step then reads about 4.4 GB of
  bf16 experts against about 1 GB of everything else, so MXFP4 experts cut its bytes by
  about 2.4x (`kdaserve make-model --preset kimi-k3-mini --count` prints the split).
- kimi-k3: the full dimensions (docs: shared/reference kimi_k3.md §1.2). The layer count,
  layer lists, AttnRes block size, MTP count, routed scaling and context length are not in
  vLLM's source; they follow the published config.json.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import os

import torch

from kdaserve.config.model_args import MXFP4_FORMAT, KimiLinearArgs
from kdaserve.kernels.mxfp4.format import packed_bytes, quantize_mxfp4

K3_PRESETS = ("kimi-k3-tiny", "kimi-k3-mini", "kimi-k3")

BOS, EOS, PAD, UNK = "[BOS]", "[EOS]", "[PAD]", "[UNK]"
END_OF_MSG = "<|end_of_msg|>"
"""K3's turn terminator: the config's eos_token_id (the tokenizer's eos is [EOS])."""
K3_SPECIAL = [BOS, EOS, PAD, UNK, END_OF_MSG, "<|media_begin|>", "<|media_content|>",
              "<|media_pad|>", "<|media_end|>", "<|kimi_image_placeholder|>"]
"""Special tokens (dropped by skip_special_tokens)."""
K3_MARKUP = ["<|open|>", "<|close|>", "<|sep|>"]
"""XTML markup the reasoning and tool parsers read: single ids, kept on decode."""
NUM_SPECIAL = 258
"""Kimi's reserved special ids after the ranks (tokenizer.py NUM_RESERVED_SPECIAL_TOKENS + 2)."""
TINY_VOCAB = 4096


def _layers(n: int, every: int, extra_last: bool) -> tuple[list[int], list[int]]:
    """(kda_layers, full_attn_layers), 1-based: every `every`-th layer full attention, and
    the last one too when extra_last."""
    full = [i for i in range(1, n + 1) if i % every == 0 or (extra_last and i == n)]
    return [i for i in range(1, n + 1) if i not in full], full


def text_arch(preset: str) -> dict:
    if preset == "kimi-k3-tiny":
        kda, full = [1, 3, 4, 5], [2, 6]
        return dict(
            hidden_size=64, num_hidden_layers=6, attn_res_block_size=2,
            linear_attn_config=dict(num_heads=2, head_dim=16, short_conv_kernel_size=4,
                                    kda_layers=kda, full_attn_layers=full,
                                    use_full_rank_gate=True, gate_lower_bound=-5.0),
            num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128, num_experts=8,
            num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=2,
            routed_expert_hidden_size=32, num_nextn_predict_layers=1, model_max_length=4096,
            routed_scaling_factor=2.5)
    if preset == "kimi-k3-mini":
        kda, full = _layers(12, 4, False)
        return dict(
            hidden_size=2048, num_hidden_layers=12, attn_res_block_size=4,
            linear_attn_config=dict(num_heads=16, head_dim=128, short_conv_kernel_size=4,
                                    kda_layers=kda, full_attn_layers=full,
                                    use_full_rank_gate=True, gate_lower_bound=-5.0),
            num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, intermediate_size=4096, num_experts=256,
            num_experts_per_token=16, moe_intermediate_size=2048, num_shared_experts=1,
            routed_expert_hidden_size=2048, num_nextn_predict_layers=1,
            model_max_length=131072, routed_scaling_factor=2.5)
    kda, full = _layers(93, 4, True)
    return dict(
        hidden_size=7168, num_hidden_layers=93, attn_res_block_size=12,
        linear_attn_config=dict(num_heads=96, head_dim=128, short_conv_kernel_size=4,
                                kda_layers=kda, full_attn_layers=full,
                                use_full_rank_gate=True, gate_lower_bound=-5.0),
        num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, intermediate_size=33792, num_experts=896,
        num_experts_per_token=16, moe_intermediate_size=3072, num_shared_experts=2,
        routed_expert_hidden_size=3584, num_nextn_predict_layers=1, vocab_size=163840,
        model_max_length=1048576, routed_scaling_factor=1.0)


def quantization_config() -> dict:
    """compressed-tensors MXFP4 of the routed experts only (everything else stays bf16)."""
    weights = dict(num_bits=4, type="float", group_size=32, strategy="group", symmetric=True,
                   dynamic=False, observer="minmax", scale_dtype="torch.uint8")
    return dict(quant_method="compressed-tensors", format=MXFP4_FORMAT,
                quantization_status="compressed",
                config_groups=dict(group_0=dict(format=MXFP4_FORMAT, weights=weights,
                                                input_activations=None,
                                                targets=["re:.*experts\\.\\d+\\.w[123]$"])),
                ignore=["re:.*self_attn.*", "re:.*shared_experts.*",
                        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
                        "re:.*vision_tower.*", "re:.*mm_projector.*"])


def k3_config(preset: str, token_ids: dict[str, int], vocab_size: int) -> dict:
    """config.json of a K3 preset; token_ids: bos / eos (<|end_of_msg|>) / pad / media pad."""
    text = dict(
        model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], dtype="bfloat16",
        vocab_size=vocab_size, hidden_act="situ", activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0, first_k_dense_replace=1, moe_layer_freq=1,
        moe_router_activation_func="sigmoid", moe_renormalize=True, topk_method="noaux_tc",
        use_grouped_topk=True, num_expert_group=1, topk_group=1, mla_use_nope=True,
        mla_use_output_gate=True, latent_moe_use_norm=True, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=token_ids["bos"],
        eos_token_id=token_ids["eos"], pad_token_id=token_ids["pad"],
        quantization_config=quantization_config())
    text.update(copy.deepcopy(text_arch(preset)))
    cfg = dict(architectures=["KimiK3ForConditionalGeneration"], model_type="kimi_k3",
               text_config=text, bos_token_id=text["bos_token_id"],
               eos_token_id=text["eos_token_id"], pad_token_id=text["pad_token_id"],
               media_placeholder_token_id=token_ids["media_pad"])
    if preset == "kimi-k3":   # the real checkpoint's vision tower: declared, not served
        cfg["vision_config"] = dict(model_type="kimi_k3_vision", patch_size=14,
                                    vt_hidden_size=1024, vt_num_hidden_layers=27,
                                    vt_num_attention_heads=12, vt_intermediate_size=4096)
    return cfg


# ----------------------------------------------------------------------------------------------
# Tokenizer: the Kimi tiktoken layout
# ----------------------------------------------------------------------------------------------

def write_k3_tokenizer(out_dir: str, model_max_length: int) -> dict[str, int]:
    """tiktoken.model (the ranks of a byte-level BPE trained on the shipped corpus),
    tokenizer_config.json (the special tokens as added_tokens_decoder, the K3 chat template)
    and chat_template.jinja. Returns the ids of the tokens the config names."""
    from kdaserve.models.make_model import train_tokenizer
    from kdaserve.models.tokenizer import K3_CHAT_TEMPLATE, _byte_chars

    tok = train_tokenizer(TINY_VOCAB - NUM_SPECIAL, with_added_tokens=False)
    decode = {c: b for b, c in _byte_chars().items()}
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    lines = [base64.b64encode(bytes(decode[c] for c in token)).decode() + f" {rank}"
             for rank, (token, _) in enumerate(vocab)]
    with open(os.path.join(out_dir, "tiktoken.model"), "w", encoding="ascii") as f:
        f.write("\n".join(lines) + "\n")
    n = len(vocab)
    ids = {t: n + i for i, t in enumerate(K3_SPECIAL + K3_MARKUP)}
    added = {str(i): dict(content=t, lstrip=False, normalized=False, rstrip=False,
                          single_word=False, special=t not in K3_MARKUP)
             for t, i in ids.items()}
    with open(K3_CHAT_TEMPLATE, encoding="utf-8") as f:
        template = f.read()
    cfg = dict(added_tokens_decoder=added, bos_token=BOS, eos_token=EOS, pad_token=PAD,
               unk_token=UNK, model_max_length=model_max_length,
               clean_up_tokenization_spaces=False, tokenizer_class="TikTokenTokenizer",
               chat_template=template)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    return dict(bos=ids[BOS], eos=ids[END_OF_MSG], pad=ids[PAD],
                media_pad=ids["<|media_pad|>"], tokenizer_eos=ids[EOS],
                vocab_size=64 * -(-(n + NUM_SPECIAL) // 64))


# ----------------------------------------------------------------------------------------------
# Weights in the K3 name scheme
# ----------------------------------------------------------------------------------------------

def k3_checkpoint(args: KimiLinearArgs, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights (make_model.random_weights' init, MTP layers included) renamed to the K3
    checkpoint scheme, routed experts quantised to compressed-tensors MXFP4 per expert."""
    from kdaserve.models.loader import expected_tensors
    from kdaserve.models.make_model import random_tensors

    plain = dataclasses.replace(args, expert_quantization=None)
    fused = random_tensors(expected_tensors(plain, torch.bfloat16, include_mtp=True), seed)
    out: dict[str, torch.Tensor] = {}
    for name, t in fused.items():
        for k3_name, tensor in _k3_names(name, t, args):
            out["language_model." + k3_name] = tensor.contiguous()
    return out


def _k3_names(name: str, t: torch.Tensor, args: KimiLinearArgs):
    """One fused-scheme tensor -> its (name, tensor) pieces in the K3 scheme."""
    moe = ".mlp." in name and any(k in name for k in (
        ".mlp.gate.", ".mlp.experts.", ".mlp.shared_experts.", ".mlp.routed_expert_"))
    if moe:
        name = name.replace(".mlp.", ".block_sparse_moe.")
    if name.endswith(".self_attn.conv1d.weight"):
        base = name.removesuffix("conv1d.weight")
        return [(base + f"{c}_conv1d.weight", part)
                for c, part in zip("qkv", t.chunk(3, dim=0))]
    if ".self_attn.forget_gate." in name:
        name = name.replace(".forget_gate.", ".")
        return [(name, t.reshape(-1) if name.endswith(".A_log") else t)]
    if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
        base = name.rsplit(".", 1)[0] + "."
        pieces = []
        for e in range(t.shape[0]):
            if name.endswith("gate_up_proj"):
                w = dict(zip(("w1", "w3"), t[e].chunk(2, dim=0)))
            else:
                w = {"w2": t[e]}
            for wn, weight in w.items():
                if args.expert_quantization == "mxfp4":
                    packed, scale = quantize_mxfp4(weight)
                    pieces += [(f"{base}{e}.{wn}.weight_packed", packed),
                               (f"{base}{e}.{wn}.weight_scale", scale)]
                else:
                    pieces.append((f"{base}{e}.{wn}.weight", weight))
        return pieces
    return [(name, t)]


# ----------------------------------------------------------------------------------------------
# Parameter and byte count
# ----------------------------------------------------------------------------------------------

def count(args: KimiLinearArgs, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Parameters and bytes of the served model (MTP layers apart): routed experts at their
    storage (MXFP4: 4.25 bits per weight), everything else in dtype."""
    from kdaserve.models.loader import expected_tensors

    plain = dataclasses.replace(args, expert_quantization=None)
    mtp_names = set(expected_tensors(plain, dtype, include_mtp=True)) - set(
        expected_tensors(plain, dtype))
    c = dict(params=0, bytes=0, expert_params=0, expert_bytes=0, mtp_params=0, mtp_bytes=0)
    elt = torch.empty((), dtype=dtype).element_size()
    for name, (shape, dt) in expected_tensors(plain, dtype, include_mtp=True).items():
        numel = 1
        for s in shape:
            numel *= s
        expert = ".experts." in name
        if expert and args.expert_quantization == "mxfp4":
            size = shape[0] * packed_bytes(shape[1], shape[2])
        else:
            size = numel * (4 if dt == torch.float32 else elt)
        kind = "mtp" if name in mtp_names else "model"
        if kind == "mtp":
            c["mtp_params"] += numel
            c["mtp_bytes"] += size
            continue
        c["params"] += numel
        c["bytes"] += size
        if expert:
            c["expert_params"] += numel
            c["expert_bytes"] += size
    return c


STEP_CONTEXT = 8192
"""Context tokens of the batch-1 decode step that step_bytes counts."""


def step_bytes(args: KimiLinearArgs, context: int = STEP_CONTEXT,
               dtype: torch.dtype = torch.bfloat16) -> dict[str, int | float]:
    """The bytes a batch-1 decode step must read (engine/floor.py's floor): every non-expert
    weight once (the embedding apart: one row), the top-k routed experts of every MoE layer, in
    model dtype and in MXFP4 (4.25 bits a weight), the MLA latent KV of `context` tokens and the
    KDA states (read and written). floor_ratio: the step's bytes with model-dtype experts over
    those with MXFP4 experts, the most the format can speed a bandwidth-bound step."""
    from kdaserve.attention.caches import state_bytes_per_slot
    from kdaserve.models.loader import expected_tensors

    plain = dataclasses.replace(args, expert_quantization=None)
    elt = torch.empty((), dtype=dtype).element_size()
    dense, expert_weights, moe_layers = 0, 0, 0
    for name, (shape, dt) in expected_tensors(plain, dtype).items():
        numel = 1
        for n in shape:
            numel *= n
        if ".experts." in name:
            expert_weights += numel
            moe_layers += name.endswith("gate_up_proj")
        elif "embed_tokens" not in name:
            dense += numel * (4 if dt == torch.float32 else elt)
    per_token = args.num_experts_per_token * expert_weights // max(1, args.num_experts)
    c = dict(dense_bytes=dense, active_expert_params=per_token,
             active_expert_bytes_bf16=per_token * elt,
             active_expert_bytes_mxfp4=per_token * 17 // 32,
             kv_bytes=context * args.kv_cache_dim * elt * len(args.mla_layer_ids),
             state_bytes=2 * state_bytes_per_slot(args, dtype), context=context,
             moe_layers=moe_layers)
    rest = c["dense_bytes"] + c["kv_bytes"] + c["state_bytes"]
    c["step_bytes_bf16"] = rest + c["active_expert_bytes_bf16"]
    c["step_bytes_mxfp4"] = rest + c["active_expert_bytes_mxfp4"]
    c["floor_ratio"] = c["step_bytes_bf16"] / c["step_bytes_mxfp4"]
    return c


def _amount(n: float, units: tuple[str, ...], base: float) -> str:
    for unit in units:
        if n < base or unit == units[-1]:
            return f"{n:.2f} {unit}".rstrip()
        n /= base
    raise AssertionError(units)


def format_step_bytes(c: dict) -> str:
    def mb(n):
        return f"{n / 1e6:.0f} MB"

    rest = c["kv_bytes"] + c["state_bytes"]
    return (f"batch-1 decode step at {c['context']} tokens of context: dense weights "
            f"{mb(c['dense_bytes'])} + MLA KV and KDA states {mb(rest)} + active routed "
            f"experts bf16 {mb(c['active_expert_bytes_bf16'])} / MXFP4 "
            f"{mb(c['active_expert_bytes_mxfp4'])} ({c['moe_layers']} MoE layers x top-k) = "
            f"bf16 {mb(c['step_bytes_bf16'])} / MXFP4 {mb(c['step_bytes_mxfp4'])}; floor "
            f"ratio bf16 / MXFP4 {c['floor_ratio']:.2f}x")


def format_count(preset: str, c: dict[str, int]) -> str:
    def params(n):
        return _amount(n, ("", "K", "M", "B", "T"), 1000.0) + " parameters"

    def size(n):
        return _amount(n, ("B", "KiB", "MiB", "GiB", "TiB"), 1024.0)

    rest_p, rest_b = c["params"] - c["expert_params"], c["bytes"] - c["expert_bytes"]
    return (f"{preset}: {params(c['params'])}, {size(c['bytes'])} (routed experts "
            f"{params(c['expert_params'])}, {size(c['expert_bytes'])}; the rest "
            f"{params(rest_p)}, {size(rest_b)}); MTP layers {params(c['mtp_params'])}, "
            f"{size(c['mtp_bytes'])}")
