"""The Kimi tokenizer layout (tiktoken.model + tokenizer_config.json, no tokenizer.json) loads
natively, without remote code, and gives the ids of a tiktoken encoding made here; the K3 presets
ship it with the XTML chat template."""

from __future__ import annotations

import base64
import collections
import json
import os

import pytest

tiktoken = pytest.importorskip("tiktoken")

from kdaserve.models.tokenizer import TiktokenTokenizer, get_tokenizer  # noqa: E402
from tests.models.k3_tiny import k3_tiny_dir, one_torch_thread  # noqa: E402,F401

PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""",
    r"""\s+""",
])
"""Kimi's split (tokenization_kimi.py), written out here independently of kdaserve's copy."""
TRAIN = ("the quick brown fox jumps over the lazy dog; the dog sleeps. " * 8
         + "def f(x):\n    return x * 2\n" * 4 + "中文测试 日本語 한국어 " * 4)
TEXTS = ["The quick brown fox, the lazy dog!", "def f(x):\n    return x * 2\n\n\tdone",
         "中文测试，日本語のテキスト 😀", "  spaces   and\r\nnewlines  ", "I'LL we'VE don't",
         "<|im_user|>user<|im_middle|>hi<|im_end|>", "x" * 30_000 + " " * 26_000 + "y"]
SPECIAL = {"[BOS]": True, "[EOS]": True, "<|im_end|>": True, "<|im_user|>": True,
           "<|im_middle|>": True, "<|open|>": False}


def bpe_ranks(text: str, merges: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then the most frequent adjacent pair merged,
    `merges` times (tiktoken's ranks file semantics: lower rank = earlier merge)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in w.encode()] for w in text.split(" ")]
    for _ in range(merges):
        pairs = collections.Counter((a, b) for w in words for a, b in zip(w, w[1:]))
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks.setdefault(a + b, len(ranks))
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                i += 1
    return ranks


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_tok")
    ranks = bpe_ranks(TRAIN, 80)
    with open(path / "tiktoken.model", "w") as f:
        for tok, rank in ranks.items():
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    n = len(ranks)
    added = {str(n + i): {"content": t, "special": s} for i, (t, s) in enumerate(SPECIAL.items())}
    cfg = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]",
           "chat_template": "{% for m in messages %}<|im_user|>{{ m.content }}<|im_end|>"
                            "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    specials = {t: n + i for i, t in enumerate(SPECIAL)}
    specials |= {f"<|reserved_token_{i}|>": i for i in range(n + len(SPECIAL), n + 258)}
    enc = tiktoken.Encoding("test", pat_str=PAT, mergeable_ranks=ranks, special_tokens=specials)
    return str(path), enc, n


def test_same_ids_as_tiktoken(folder):
    path, enc, n = folder
    tok = get_tokenizer(path)
    assert isinstance(tok, TiktokenTokenizer)
    assert len(tok) == enc.n_vocab == n + 258
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=True)
        # runs longer than 25,000 (non-)whitespace characters are cut first, as Kimi does
        pieces = [text] if len(text) < 25_000 else [text[:25_000], text[25_000:55_000],
                                                    text[55_000:]]
        assert ids == [i for p in pieces for i in enc.encode(p, allowed_special="all")], text[:40]
        assert tok.decode(ids) == text


def test_special_tokens_from_the_config(folder):
    path, _, n = folder
    tok = get_tokenizer(path, trust_remote_code=True)     # native whatever the flag says
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.bos_token_id == n and tok.eos_token_id == n + 1
    assert tok.convert_tokens_to_ids("<|im_end|>") == n + 2
    assert tok.convert_ids_to_tokens(n + 10) == f"<|reserved_token_{n + 10}|>"
    ids = tok.encode("<|open|>a<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "<|open|>a"   # special: false stays
    assert n + 2 in tok.all_special_ids and n + 5 not in tok.all_special_ids
    words = tok.convert_ids_to_tokens(tok.encode(" the dog"))
    assert tok.convert_tokens_to_ids(words) == tok.encode(" the dog")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True) == "<|im_user|>hi<|im_end|>A:"


def test_other_folders_go_to_transformers(tmp_path):
    from tests.engine.conftest import _write_tokenizer

    _write_tokenizer(str(tmp_path))
    assert not isinstance(get_tokenizer(str(tmp_path)), TiktokenTokenizer)


def test_k3_preset_tokenizer_and_chat_format(k3_tiny_dir):  # noqa: F811
    assert not os.path.exists(os.path.join(k3_tiny_dir, "tokenizer.json"))
    tok = get_tokenizer(k3_tiny_dir)
    assert isinstance(tok, TiktokenTokenizer)
    for t in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"):
        assert len(tok.encode(t)) == 1
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm",
             "tool_calls": [{"function": {"name": "get", "arguments": {
                 "city": 'Paris "FR" & co', "days": 2}}}]},
            {"role": "tool", "name": "get", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "get", "parameters": {}}}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True,
                                   thinking_effort="max")
    assert text.startswith('<|open|>message role="system" type="tool-declare"<|sep|># Tools')
    assert "`thinking_effort=max`" in text
    assert ('<|open|>message role="user"<|sep|>Weather?<|close|>message<|sep|><|end_of_msg|>'
            in text)
    assert ('<|open|>think<|sep|>hmm<|close|>think<|sep|><|open|>response<|sep|>Let me look.'
            '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get" index="1"'
            '<|sep|><|open|>argument key="city" type="string"<|sep|>Paris "FR" & co'
            '<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>2'
            '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>') in text
    assert '<|open|>message role="tool" name="get"<|sep|>sunny' in text
    assert text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    off = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True,
                                  thinking=False)
    assert "thinking-effort" not in off
    assert off.endswith('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    escaped = tok.apply_chat_template([{"role": "tool", "name": 'a"&b', "content": "x"}],
                                      tokenize=False)
    assert 'name="a&quot;&amp;b"' in escaped
    with pytest.raises(Exception, match="thinking_effort"):
        tok.apply_chat_template(msgs[:1], tokenize=False, thinking_effort="medium")


def test_k3_folder_without_template_gets_the_xtml_one(k3_tiny_dir, tmp_path):  # noqa: F811
    import shutil

    for name in ("tiktoken.model", "config.json"):
        shutil.copy(os.path.join(k3_tiny_dir, name), tmp_path / name)
    with open(os.path.join(k3_tiny_dir, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = get_tokenizer(str(tmp_path))
    assert tok.chat_template == get_tokenizer(k3_tiny_dir).chat_template


def test_k3_template_refuses_images(k3_tiny_dir):  # noqa: F811
    tok = get_tokenizer(k3_tiny_dir)
    msg = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                        {"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(Exception, match="only the text model"):
        tok.apply_chat_template(msg, tokenize=False)
