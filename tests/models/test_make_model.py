"""`kdaserve make-model`: the folder loads in transformers and in kdaserve, the tokenizer and chat
template behave, the CLI works, and the presets have the promised shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from kdaserve.config import LoadConfig
from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.models.loader import expected_tensors, load_weights
from kdaserve.models.make_model import (MARKUP_TOKENS, SPECIAL_TOKENS, build_hf_tokenizer,
                                        make_model, preset_config)

transformers = pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = [
    "The lighthouse keeper wrote three lines in the ledger.",
    "def f(x):\n    return {'a': [1, 2.5, None]}  # comment\n\n\ttabbed",
    '{"role": "tool", "content": "{\\"temp\\": 18.5}"}',
    "Größe, café, naïve — 中文测试，日本語のテキスト，한국어 😀🚀 ½ ≠ ∞",
    "  leading and trailing spaces  \r\n",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", seed=0)


@pytest.fixture(scope="module")
def tok(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def read_weights(path: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# --- model --------------------------------------------------------------------------------------

def test_folder_contents(tiny, tok):
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja"):
        assert os.path.isfile(os.path.join(tiny, name)), name
    cfg = read_config(tiny)
    assert cfg["model_type"] == "kimi_linear"
    assert cfg["architectures"] == ["KimiLinearForCausalLM"]
    assert cfg["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    assert cfg["linear_attn_config"]["full_attn_layers"] == [4]
    assert cfg["vocab_size"] % 64 == 0 and len(tok) <= cfg["vocab_size"] < len(tok) + 64
    assert cfg["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    assert cfg["bos_token_id"] == tok.convert_tokens_to_ids("[BOS]")
    with open(os.path.join(tiny, "generation_config.json")) as f:
        gen = json.load(f)
    assert gen["eos_token_id"] == [cfg["eos_token_id"], tok.convert_tokens_to_ids("[EOS]")]
    args = KimiLinearArgs.from_hf_config(cfg)
    assert args.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert (args.hidden_size, args.linear_num_heads, args.linear_head_dim) == (64, 2, 16)
    assert (args.num_experts, args.num_experts_per_token, args.max_position_embeddings) == \
        (8, 2, 4096)


def test_weights_follow_expected_tensors(tiny):
    args = KimiLinearArgs.from_hf_config(read_config(tiny))
    exp = expected_tensors(args, torch.bfloat16)
    w = read_weights(tiny)
    assert sorted(w) == sorted(exp)
    for name, (shape, dtype) in exp.items():
        assert (tuple(w[name].shape), w[name].dtype) == (shape, dtype), name
    assert torch.all(w["model.norm.weight"] == 1)
    a = torch.exp(w["model.layers.1.self_attn.forget_gate.A_log"])
    assert torch.all((a >= 1) & (a <= 16))
    dt = torch.nn.functional.softplus(w["model.layers.1.self_attn.forget_gate.dt_bias"])
    assert torch.all((dt > 0.9e-3) & (dt < 0.11))
    std = w["model.layers.1.mlp.experts.gate_up_proj"].float().std()
    assert 0.015 < std < 0.025


def test_transformers_loads_and_generates(tiny, tok):
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    ids = tok(TEXTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.isfinite(logits).all()
        out = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    assert len(set(out.tolist())) >= 6, out.tolist()  # varied, not one repeated token
    # routing is spread: tokens of one prompt do not all pick the same experts
    picks = []
    gate = model.model.layers[1].mlp.gate
    h = gate.register_forward_hook(lambda _m, _i, o: picks.append(o[2].sort(-1).values))
    with torch.no_grad():
        model(ids)
    h.remove()
    assert len({tuple(r.tolist()) for r in picks[0]}) > 1


def test_kdaserve_model_loads(tiny):
    from kdaserve.models.registry import build_model

    args = KimiLinearArgs.from_hf_config(read_config(tiny))
    model = build_model(args, torch.float32, "cpu")
    load_weights(model, tiny, LoadConfig())
    w = read_weights(tiny)
    sd = model.state_dict()
    assert sorted(sd) == sorted(w)
    for name, t in sd.items():
        assert torch.equal(t, w[name].to(t.dtype)), name


def test_seed_changes_weights(tmp_path, tiny):
    other = make_model(str(tmp_path / "s1"), preset="tiny", seed=1)
    a, b = read_weights(tiny), read_weights(other)
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    again = make_model(str(tmp_path / "s0"), preset="tiny", seed=0)
    c = read_weights(again)
    assert all(torch.equal(a[k], c[k]) for k in a)
    with open(os.path.join(tiny, "tokenizer.json")) as f1, \
            open(os.path.join(again, "tokenizer.json")) as f2:
        assert f1.read() == f2.read()  # tokenizer training is deterministic


# --- tokenizer ----------------------------------------------------------------------------------

def test_tokenizer_round_trip(tiny, tok):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast.from_pretrained(tiny)
    for text in TEXTS:
        for t in (tok, fast):
            ids = t(text, add_special_tokens=True).input_ids
            assert ids and max(ids) < len(t)
            assert t.decode(ids) == text
    assert len(tok("The lighthouse keeper").input_ids) <= 5  # merges were learned
    assert 2000 <= len(tok) <= 4096


def test_special_tokens_single_ids(tok):
    for t in SPECIAL_TOKENS + MARKUP_TOKENS:
        ids = tok(f"a{t}b", add_special_tokens=False).input_ids
        tid = tok.convert_tokens_to_ids(t)
        assert tid in ids and tok.convert_ids_to_tokens(tid) == t, t
        assert tok(t, add_special_tokens=False).input_ids == [tid], t
    # control tokens vanish with skip_special_tokens; reasoning / tool markup stays for parsers
    ids = tok("<|im_user|>hi<|im_end|><think>x</think>", add_special_tokens=False).input_ids
    assert tok.decode(ids, skip_special_tokens=True) == "hi<think>x</think>"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "[PAD]" and tok.bos_token == "[BOS]"


# --- chat template ------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Tokyo?"},
    {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
     "tool_calls": [{"id": "call_abc", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "18C, rain"},
    {"role": "assistant", "content": "18C and rainy."},
    {"role": "user", "content": [{"type": "text", "text": "And in Paris?"}]},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "functions.get_weather:1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "21C"},
]


def test_chat_template_full_conversation(tok):
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True,
                                   tokenize=False)
    expected_parts = [
        "<|im_system|>tool_declare<|im_middle|>[", '"name": "get_weather"', "]<|im_end|>",
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|>",
        "<|im_user|>user<|im_middle|>Weather in Tokyo?<|im_end|>",
        "<|im_assistant|>assistant<|im_middle|><think>Use the tool.</think>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Tokyo"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>",
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18C, rain<|im_end|>",
        "<|im_assistant|>assistant<|im_middle|>18C and rainy.<|im_end|>",
        "<|im_user|>user<|im_middle|>And in Paris?<|im_end|>",
        "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>",
        '{"city": "Paris"}<|tool_call_end|>',
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\n21C<|im_end|>",
    ]
    pos = 0
    for part in expected_parts:
        found = text.find(part, pos)
        assert found >= 0, f"{part!r} missing (in order) from:\n{text}"
        pos = found + len(part)
    assert text.endswith("<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert text.count("<|im_end|>") == 9
    # tokenized, every marker is one id
    ids = tok.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|tool_call_begin|>")) == 2
    assert ids.count(tok.eos_token_id) == 9
    assert tok.decode(ids) == text


def test_chat_template_generation_prompt_and_thinking(tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == "<|im_user|>user<|im_middle|>hi<|im_end|>"
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert on.endswith("<|im_end|><|im_assistant|>assistant<|im_middle|>")
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                  thinking=False)
    assert off == on + "<think></think>"


def test_chat_template_files_agree(tiny):
    with open(os.path.join(tiny, "tokenizer_config.json")) as f:
        inline = json.load(f)["chat_template"]
    with open(os.path.join(tiny, "chat_template.jinja")) as f:
        assert f.read() == inline


# --- presets and CLI ----------------------------------------------------------------------------

def test_cli_make_model(tmp_path):
    out = tmp_path / "cli_tiny"
    proc = subprocess.run(
        [sys.executable, "-m", "kdaserve.entrypoints.cli", "make-model", str(out),
         "--preset", "tiny", "--seed", "5"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "wrote tiny model" in proc.stdout
    args = KimiLinearArgs.from_hf_config(read_config(str(out)))
    assert args.num_hidden_layers == 4
    assert os.path.isfile(out / "model.safetensors")


def test_cli_rejects_unknown_preset(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kdaserve.entrypoints.cli", "make-model", str(tmp_path / "x"),
         "--preset", "huge"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "huge" in proc.stderr
    with pytest.raises(ValueError, match="huge"):
        make_model(str(tmp_path / "y"), preset="huge")


def test_48b_preset_is_config_only(tmp_path):
    out = make_model(str(tmp_path / "big"), preset="kimi-linear-48b-a3b")
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
    cfg = read_config(out)
    args = KimiLinearArgs.from_hf_config(cfg)
    assert len(args.kda_layer_ids) == 20 and len(args.mla_layer_ids) == 7
    assert args.mla_layer_ids == [3, 7, 11, 15, 19, 23, 26]
    assert (args.hidden_size, args.num_experts, args.vocab_size) == (2304, 256, 163840)
    numel = sum(torch.Size(s).numel() for s, _ in expected_tensors(args).values())
    assert 48e9 < numel < 50e9
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert cfg["eos_token_id"] == tok.eos_token_id


def test_small_preset_size():
    cfg = preset_config("small", build_hf_tokenizer(32768))
    args = KimiLinearArgs.from_hf_config(cfg)
    numel = sum(torch.Size(s).numel() for s, _ in expected_tensors(args).values())
    assert 20e6 <= numel <= 50e6, numel
    assert args.num_hidden_layers == 8 and args.mla_layer_ids == [3, 7]
