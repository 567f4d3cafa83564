"""`kdaserve make-model OUT --preset {tiny,tiny-mtp,small,kimi-linear-48b-a3b,kimi-k3-tiny,
kimi-k3-mini,kimi-k3}`: write a synthetic HF-style Kimi Linear or Kimi K3 model folder offline
(`--count` prints a preset's parameter and byte count instead).

The folder holds config.json, generation_config.json, a byte-level BPE tokenizer trained on the
text shipped in kdaserve/data/ (tokenizer.json + tokenizer_config.json with a Kimi-style chat
template, also chat_template.jinja) and, for tiny / tiny-mtp / small, random weights in
transformers >= 5.17 naming (model.safetensors). tiny-mtp is tiny plus one MTP layer
(num_nextn_predict_layers=1, its tensors at model.layers.4: the "mtp" drafter's test model; the
other tensors equal tiny's). The 48B preset writes the real architecture's config and the tokenizer
only: serve it with `--load-format dummy`. The Kimi K3 presets are models/make_k3.py.

`make-model OUT --draft-for TARGET [--draft-method {draft_model,dspark}]` writes a drafter for
TARGET instead: draft_model, the small architecture with TARGET's vocabulary; dspark, a
speculators-format DSpark drafter folder (models/dspark.py) with random weights.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import math
import os

import torch

from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.models import make_k3
from kdaserve.models.loader import tensor_seed, expected_tensors

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
CONFIG_48B_FILE = "kimi_linear_48b_a3b_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

BOS, EOS, PAD, IM_END = "[BOS]", "[EOS]", "[PAD]", "<|im_end|>"
# Control tokens: special (dropped by skip_special_tokens on decode).
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_END, "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                  "<|im_middle|>"]
# Markup the reasoning / tool-call parsers read in the decoded text: single ids, kept on decode.
MARKUP_TOKENS = ["<think>", "</think>", "<|tool_calls_section_begin|>",
                 "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                 "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
TOKENIZER_VOCAB_SIZE = 4096
"""Target size incl. added tokens; the shipped corpus may support fewer merges."""
# cl100k-style split: contractions, letter runs with one leading non-letter, 1-3 digit groups,
# punctuation runs, newlines, spaces.
PRETOKENIZE_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                       r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

PRESETS = ("tiny", "tiny-mtp", "small", "kimi-linear-48b-a3b") + make_k3.K3_PRESETS

# Architecture overrides on top of the 48B config (which supplies every other field).
_PRESET_ARCH = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=4,
        linear_attn_config=dict(head_dim=16, num_heads=2, short_conv_kernel_size=4,
                                kda_layers=[1, 2, 3], full_attn_layers=[4]),
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128, moe_intermediate_size=32,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
        model_max_length=4096),
    "small": dict(
        hidden_size=256, num_hidden_layers=8,
        linear_attn_config=dict(head_dim=64, num_heads=4, short_conv_kernel_size=4,
                                kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8]),
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=128, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, intermediate_size=1024, moe_intermediate_size=128,
        num_experts=32, num_experts_per_token=4, num_shared_experts=1, first_k_dense_replace=1,
        model_max_length=32768),
}
_PRESET_ARCH["tiny-mtp"] = dict(copy.deepcopy(_PRESET_ARCH["tiny"]), num_nextn_predict_layers=1)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

def corpus_files() -> list[str]:
    files = sorted(glob.glob(os.path.join(DATA_DIR, "corpus_*.txt")))
    if not files:
        raise FileNotFoundError(f"no corpus_*.txt training text in {DATA_DIR}")
    return files


def chat_template() -> str:
    with open(os.path.join(DATA_DIR, CHAT_TEMPLATE_FILE), encoding="utf-8") as f:
        return f.read()


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE, with_added_tokens: bool = True):
    """Byte-level BPE trained on the shipped corpus; added tokens get the last ids
    (with_added_tokens=False: the BPE alone, vocab_size of it)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    num_added = len(SPECIAL_TOKENS) + len(MARKUP_TOKENS) if with_added_tokens else 0
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_added, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus_files(), trainer)
    if not with_added_tokens:
        return tok
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tok


def build_hf_tokenizer(model_max_length: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(), bos_token=BOS, eos_token=IM_END, pad_token=PAD,
        model_max_length=model_max_length, clean_up_tokenization_spaces=False,
        chat_template=chat_template())


def save_tokenizer(tokenizer, out_dir: str) -> None:
    tokenizer.save_pretrained(out_dir)
    template = chat_template()
    with open(os.path.join(out_dir, CHAT_TEMPLATE_FILE), "w", encoding="utf-8") as f:
        f.write(template)
    # Also inline in tokenizer_config.json, where older loaders and other servers look for it.
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["chat_template"] = template
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

def base_config() -> dict:
    with open(os.path.join(DATA_DIR, CONFIG_48B_FILE), encoding="utf-8") as f:
        return json.load(f)


def preset_config(preset: str, tokenizer) -> dict:
    """config.json contents for `preset`, special-token ids taken from `tokenizer`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = base_config()
    if preset in _PRESET_ARCH:
        cfg.update(copy.deepcopy(_PRESET_ARCH[preset]))
        cfg["vocab_size"] = 64 * math.ceil(len(tokenizer) / 64)
    ids = tokenizer.convert_tokens_to_ids
    cfg.update(bos_token_id=ids(BOS), eos_token_id=ids(IM_END), pad_token_id=ids(PAD))
    return cfg


# ----------------------------------------------------------------------------------------------
# Random weights
# ----------------------------------------------------------------------------------------------

_NORM_SUFFIXES = ("layernorm.weight", "norm.weight")
INIT_STD = 0.02


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One tensor of a fresh model, fp32: N(0, 0.02) matrices, unit norms, and the FLA-style
    A_log / dt_bias init transformers uses (A = U(1, 16), dt = logU(1e-3, 1e-1) as softplus^-1)."""
    if name.endswith(_NORM_SUFFIXES):
        return torch.ones(shape)
    if name.endswith(".e_score_correction_bias"):
        return torch.zeros(shape)
    if name.endswith(".A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    if name.endswith(".dt_bias"):
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen)
        dt = dt.exp().clamp_min(1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    return torch.empty(shape).normal_(0.0, INIT_STD, generator=gen)


def random_weights(args: KimiLinearArgs, seed: int = 0, dtype: torch.dtype = torch.bfloat16
                   ) -> dict[str, torch.Tensor]:
    """A full random state dict for `args` in transformers >= 5.17 naming (fp32 where the model
    keeps fp32). Each tensor is seeded by (seed, name): the same name gives the same values."""
    return random_tensors(expected_tensors(args, dtype), seed)


def random_tensors(expected: dict[str, tuple[tuple[int, ...], torch.dtype]], seed: int = 0
                   ) -> dict[str, torch.Tensor]:
    """name -> (shape, dtype) to random tensors, each seeded by (seed, name)."""
    out = {}
    for name, (shape, dt) in expected.items():
        gen = torch.Generator().manual_seed(tensor_seed(seed, name))
        out[name] = _random_tensor(name, shape, gen).to(dt).contiguous()
    return out


# ----------------------------------------------------------------------------------------------
# The folder
# ----------------------------------------------------------------------------------------------

def make_model(out_dir: str, preset: str = "tiny", seed: int = 0) -> str:
    """Write the synthetic model folder for `preset` into `out_dir`; returns its path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"output path {out_dir!r} exists and is not a directory")
    os.makedirs(out_dir, exist_ok=True)
    if preset in make_k3.K3_PRESETS:
        return _make_k3_model(out_dir, preset, seed)

    max_len = int(_PRESET_ARCH.get(preset, base_config())["model_max_length"])
    tokenizer = build_hf_tokenizer(max_len)
    cfg = preset_config(preset, tokenizer)
    args = KimiLinearArgs.from_hf_config(cfg)  # validates the config we are about to write

    save_tokenizer(tokenizer, out_dir)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    gen_cfg = {"bos_token_id": cfg["bos_token_id"],
               "eos_token_id": [cfg["eos_token_id"], tokenizer.convert_tokens_to_ids(EOS)],
               "pad_token_id": cfg["pad_token_id"]}
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen_cfg, f, indent=2)

    if preset in _PRESET_ARCH:
        from safetensors.torch import save_file

        weights = random_tensors(expected_tensors(args, torch.bfloat16, include_mtp=True), seed)
        save_file(weights, os.path.join(out_dir, "model.safetensors"),
                  metadata={"format": "pt"})
    return out_dir


def _make_k3_model(out_dir: str, preset: str, seed: int) -> str:
    max_len = int(make_k3.text_arch(preset)["model_max_length"])
    ids = make_k3.write_k3_tokenizer(out_dir, max_len)
    cfg = make_k3.k3_config(preset, ids, ids["vocab_size"])
    args = KimiLinearArgs.from_hf_config(cfg)  # validates the config we are about to write
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    gen_cfg = {"bos_token_id": ids["bos"], "eos_token_id": [ids["eos"], ids["tokenizer_eos"]],
               "pad_token_id": ids["pad"]}
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen_cfg, f, indent=2)
    if preset == "kimi-k3-tiny":
        from safetensors.torch import save_file

        save_file(make_k3.k3_checkpoint(args, seed), os.path.join(out_dir, "model.safetensors"),
                  metadata={"format": "pt"})
    return out_dir


def preset_args(preset: str) -> KimiLinearArgs:
    """The architecture of `preset` (the tokenizer's vocabulary for the synthetic ones)."""
    if preset in make_k3.K3_PRESETS:
        ids = dict(bos=0, eos=1, pad=2, media_pad=3)
        vocab = 64 * -(-TOKENIZER_VOCAB_SIZE // 64)
        return KimiLinearArgs.from_hf_config(make_k3.k3_config(preset, ids, vocab))
    cfg = base_config()
    if preset in _PRESET_ARCH:
        cfg.update(copy.deepcopy(_PRESET_ARCH[preset]))
        cfg["vocab_size"] = 64 * math.ceil(TOKENIZER_VOCAB_SIZE / 64)
    return KimiLinearArgs.from_hf_config(cfg)


DSPARK_LAYERS = 2
"""Draft layers of a make-model DSpark drafter."""


def make_dspark_model(target: str, out_dir: str, seed: int = 0) -> str:
    """A speculators-format DSpark drafter folder for `target` (models/dspark.py): config.json
    (speculators_model_type "dspark"; the draft layers are the target's MLA / MLP dimensions,
    DSPARK_LAYERS dense layers; conditioned on the target's first, middle and last layers;
    mask token = the pad token) and random bf16 weights. Returns `out_dir`."""
    from safetensors.torch import save_file

    from kdaserve.layers.backends import LayerBackends
    from kdaserve.models.dspark import DSparkConfig, DSparkModel
    from kdaserve.models.registry import build_model

    with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
        target_cfg = json.load(f)
    target_args = KimiLinearArgs.from_hf_config(target_cfg)
    n = target_args.num_hidden_layers
    layer_cfg = {k: v for k, v in target_cfg.items()
                 if k not in ("linear_attn_config", "architectures", "auto_map")}
    n_draft = DSPARK_LAYERS
    layer_cfg.update(num_hidden_layers=n_draft, layer_types=["full_attention"] * n_draft,
                     mlp_layer_types=["dense"] * n_draft, num_nextn_predict_layers=0)
    layer_cfg.pop("attn_res_block_size", None)
    cfg = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
           "block_size": 8, "aux_hidden_state_layer_ids": sorted({0, n // 2, n - 1}),
           "mask_token_id": int(target_cfg.get("pad_token_id") or 0),
           "target_hidden_size": target_args.hidden_size,
           "draft_vocab_size": target_args.vocab_size, "markov_rank": 32,
           "markov_head_type": "vanilla", "enable_confidence_head": True,
           "confidence_head_with_markov": True, "sample_from_anchor": True,
           "transformer_layer_config": layer_cfg,
           "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy",
                                                        "speculative_tokens": 8}],
                                  "verifier": {"name_or_path": os.path.abspath(target),
                                               "architectures": target_cfg.get(
                                                   "architectures", [])}}}
    spec = DSparkConfig.from_dict(cfg, target_args)  # validates what we are about to write
    model = build_model(spec, torch.bfloat16, "meta", DSparkModel, LayerBackends())
    shapes = {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    save_file(random_tensors(shapes, seed), os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    return out_dir


def make_draft_model(target: str, out_dir: str, seed: int = 0) -> str:
    """A draft-model folder for speculative decoding against `target`: the `small` preset's
    architecture with the target's vocabulary (vocab_size and special token ids) and random bf16
    weights. Returns `out_dir`."""
    from safetensors.torch import save_file

    with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
        target_cfg = json.load(f)
    make_model(out_dir, "small", seed)
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.update({k: target_cfg[k] for k in ("vocab_size", "bos_token_id", "eos_token_id",
                                           "pad_token_id") if k in target_cfg})
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    save_file(random_weights(KimiLinearArgs.from_hf_config(cfg), seed),
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------

def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "make-model", help="write a synthetic Kimi Linear model folder (config, tokenizer, "
                           "random weights)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", help="output folder (created if missing)")
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--draft-for", default=None, metavar="TARGET",
                   help="write a draft model for speculative decoding against the TARGET "
                        "folder instead (--draft-method: draft_model, the small "
                        "architecture with TARGET's vocabulary; dspark, a speculators-format "
                        "DSpark drafter)")
    p.add_argument("--draft-method", choices=("draft_model", "dspark"), default="draft_model",
                   help="with --draft-for: the speculative method the draft is for")
    p.add_argument("--count", action="store_true",
                   help="print the preset's parameter and byte count (bf16, MXFP4 experts "
                        "where the preset has them, then with bf16 experts), the bytes a "
                        "batch-1 decode step reads in each expert format, and write nothing")
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    if args.count:
        import dataclasses

        arch = preset_args(args.preset)
        print(make_k3.format_count(args.preset, make_k3.count(arch)))
        if arch.expert_quantization == "mxfp4":
            bf16 = make_k3.count(dataclasses.replace(arch, expert_quantization=None))
            print(make_k3.format_count(args.preset + " with bf16 experts", bf16))
        if arch.num_experts:
            print(make_k3.format_step_bytes(make_k3.step_bytes(arch)))
        return 0
    if not args.out:
        raise SystemExit("error: make-model needs OUT (the folder to write) unless --count")
    if args.draft_for:
        make = make_dspark_model if args.draft_method == "dspark" else make_draft_model
        path = make(args.draft_for, args.out, seed=args.seed)
        print(f"wrote a {args.draft_method} drafter for {args.draft_for} to {path}")
        return 0
    path = make_model(args.out, preset=args.preset, seed=args.seed)
    with_weights = args.preset in _PRESET_ARCH or args.preset == "kimi-k3-tiny"
    what = "config, tokenizer, weights" if with_weights else "config + tokenizer"
    print(f"wrote {args.preset} model ({what}) to {path}")
    return 0
