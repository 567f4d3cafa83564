"""The tokenizer of a model folder: `get_tokenizer(path)`, used wherever a tokenizer is loaded.

Kimi checkpoints ship `tiktoken.model` (base64 token + rank per line), `tokenizer_config.json`
and `tokenization_kimi.py`, and no `tokenizer.json`: transformers would need their remote code.
Such a folder is loaded natively here (TiktokenTokenizer) whatever trust_remote_code says; every
other folder goes to transformers' AutoTokenizer, trust_remote_code passed on.
"""

from __future__ import annotations

import base64
import json
import os
from functools import cached_property
from typing import Any

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
"""The pre-tokenizer split of Kimi's tiktoken tokenizer (tokenization_kimi.py)."""
NUM_RESERVED_SPECIAL_TOKENS = 256
"""Kimi reserves 256 + 2 special ids after the ranks; names come from added_tokens_decoder,
the rest are `<|reserved_token_{id}|>`."""
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
"""tiktoken's regex engine fails on very long inputs and very long runs of (non-)whitespace:
the text is cut into pieces of at most these sizes first, as Kimi's tokenizer does."""


K3_CHAT_TEMPLATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 "data", "chat_template_k3.jinja")
"""K3's XTML chat format, the template of folders of model_type kimi_k3 that ship none."""


def _model_type(path: str) -> str | None:
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError):
        return None


def get_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer of `path` (a folder, or a hub id transformers resolves)."""
    if is_tiktoken_folder(path):
        return TiktokenTokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def is_tiktoken_folder(path: str) -> bool:
    """A Kimi-style folder: tiktoken.model and tokenizer_config.json, no tokenizer.json."""
    return (os.path.isfile(os.path.join(path, TIKTOKEN_FILE))
            and os.path.isfile(os.path.join(path, CONFIG_FILE))
            and not os.path.isfile(os.path.join(path, "tokenizer.json")))


def read_ranks(path: str) -> dict[bytes, int]:
    """A tiktoken ranks file: one `base64(token) rank` per line."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _token_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the HF token strings of byte-level BPE)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def _split_runs(text: str) -> list[str]:
    """text cut so no piece exceeds MAX_ENCODE_CHARS nor holds a run of more than
    MAX_RUN_CHARS whitespace or non-whitespace characters (cuts only inside such runs)."""
    pieces = []
    for i in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[i:i + MAX_ENCODE_CHARS]
        start, run, space = 0, 0, chunk[:1].isspace()
        for j, ch in enumerate(chunk):
            if ch.isspace() != space:
                space, run = ch.isspace(), 1
            else:
                run += 1
                if run > MAX_RUN_CHARS:
                    pieces.append(chunk[start:j])
                    start, run = j, 1
        pieces.append(chunk[start:])
    return pieces


def _deep_sorted(obj: Any) -> Any:
    """Dict keys sorted at every level: tool schemas render the same whatever their order."""
    if isinstance(obj, dict):
        return {k: _deep_sorted(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [_deep_sorted(v) for v in obj]
    return obj


class TiktokenTokenizer:
    """A Kimi tiktoken folder as the subset of transformers' tokenizer interface kdaserve uses
    (encode, decode, convert_*, apply_chat_template, the special-token ids, len()).

    Ids: the ranks of tiktoken.model, then NUM_RESERVED_SPECIAL_TOKENS + 2 special tokens
    named by tokenizer_config.json's added_tokens_decoder. Special tokens in the text are
    encoded as their ids (Kimi's default). skip_special_tokens drops the added tokens marked
    "special": true and the unnamed reserved ids; those marked false (markup the parsers
    read) stay. encode adds no BOS, with add_special_tokens or not (Kimi adds none)."""

    def __init__(self, path: str) -> None:
        import tiktoken

        self.name_or_path = path
        with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
            cfg = json.load(f)
        ranks = read_ranks(os.path.join(path, TIKTOKEN_FILE))
        n = len(ranks)
        added = {int(i): d for i, d in (cfg.get("added_tokens_decoder") or {}).items()}
        count = max([NUM_RESERVED_SPECIAL_TOKENS + 2] + [i - n + 1 for i in added])
        self.special_tokens = {_token_content(added[i]) if i in added
                               else f"<|reserved_token_{i}|>": i for i in range(n, n + count)}
        self.encoding = tiktoken.Encoding(name=os.path.basename(os.path.abspath(path)),
                                          pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                          special_tokens=self.special_tokens)
        self._skip_ids = frozenset(i for i in range(n, n + count)
                                   if i not in added or added[i].get("special", True))
        self._id_to_special = {i: t for t, i in self.special_tokens.items()}
        self._ranks = ranks
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            setattr(self, name, _token_content(cfg.get(name)))
        self.model_max_length = cfg.get("model_max_length")
        self.chat_template = cfg.get("chat_template")
        template_file = os.path.join(path, CHAT_TEMPLATE_FILE)
        if self.chat_template is None and os.path.isfile(template_file):
            with open(template_file, encoding="utf-8") as f:
                self.chat_template = f.read()
        if self.chat_template is None and _model_type(path) == "kimi_k3":
            # Kimi K3 renders chats in Python (no template ships): kdaserve's XTML template
            with open(K3_CHAT_TEMPLATE, encoding="utf-8") as f:
                self.chat_template = f.read()

    # --------------------------------------------------------------------------- ids

    def __len__(self) -> int:
        return self.encoding.n_vocab

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.special_tokens.get(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self._skip_ids)

    @property
    def all_special_tokens(self) -> list[str]:
        return [self._id_to_special[i] for i in self.all_special_ids]

    @cached_property
    def _byte_encoder(self) -> dict[int, str]:
        return _byte_chars()

    @cached_property
    def _byte_decoder(self) -> dict[str, int]:
        return {c: b for b, c in self._byte_encoder.items()}

    def _token_str(self, i: int) -> str:
        if i in self._id_to_special:
            return self._id_to_special[i]
        return "".join(self._byte_encoder[b] for b in self.encoding.decode_single_token_bytes(i))

    def convert_ids_to_tokens(self, ids):
        """Byte-level token strings (GPT-2's byte map), special tokens by name."""
        if isinstance(ids, int):
            return self._token_str(ids)
        return [self._token_str(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        def one(tok: str) -> int | None:
            if tok in self.special_tokens:
                return self.special_tokens[tok]
            try:
                return self._ranks.get(bytes(self._byte_decoder[c] for c in tok),
                                       self.unk_token_id)
            except KeyError:
                return self.unk_token_id
        return one(tokens) if isinstance(tokens, str) else [one(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return {self._token_str(i): i for i in range(len(self))}

    # --------------------------------------------------------------------------- text

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        ids: list[int] = []
        for piece in _split_runs(text):
            ids.extend(self.encoding.encode(piece, allowed_special="all"))
        return ids

    def decode(self, ids, skip_special_tokens: bool = False, **_: Any) -> str:
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._skip_ids]
        return self.encoding.decode_bytes(ids).decode("utf-8", errors="replace")

    def batch_decode(self, seqs, skip_special_tokens: bool = False, **kw: Any) -> list[str]:
        return [self.decode(s, skip_special_tokens, **kw) for s in seqs]

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools=None,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            chat_template: str | None = None, **kwargs: Any):
        """Render the chat template (transformers' Jinja environment) with tools deep-sorted
        (the rendering does not depend on key order); token ids when tokenize."""
        from transformers.utils.chat_template_utils import render_jinja_template

        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(f"{self.name_or_path!r} has no chat template")
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            kwargs.setdefault(name, getattr(self, name))
        rendered, _ = render_jinja_template(
            conversations=[conversation], tools=_deep_sorted(tools) if tools else tools,
            chat_template=template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **kwargs)
        return self.encode(rendered[0]) if tokenize else rendered[0]
