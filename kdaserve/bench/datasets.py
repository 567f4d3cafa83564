# SPDX-License-Identifier: Apache-2.0
"""Synthetic prompts of exact token lengths.

Text prompts are built from random vocabulary tokens, decoded, re-tokenized and fixed up until
the tokenizer counts exactly the requested number of tokens. Every prompt draws its own random
tokens (seeded), so prompts share no prefix unless a shared prefix is asked for.

The tokenizer is loaded with `tokenizers` from a `tokenizer.json` when there is one (no torch
import), else with `kdaserve.models.tokenizer.get_tokenizer` (a Kimi tiktoken folder natively,
else transformers' AutoTokenizer); a folder holding only a `config.json` still
supports token-id prompts (ids drawn below its `vocab_size`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np


class PromptTokenizer:
    """What a prompt generator needs from a tokenizer: encode, decode (one, a batch), usable ids."""

    def __init__(self, name: str, vocab_size: int, special_ids: set[int],
                 encode_fn=None, decode_fn=None, decode_batch_fn=None):
        self.name = name
        self.vocab_size = vocab_size
        self.special_ids = special_ids
        self._encode = encode_fn
        self._decode = decode_fn
        self._decode_batch = decode_batch_fn
        self._candidates: np.ndarray | None = None

    @property
    def can_text(self) -> bool:
        return self._encode is not None

    def encode(self, text: str) -> list[int]:
        if self._encode is None:
            raise RuntimeError(f"tokenizer {self.name!r} has only a vocab size: no text prompts "
                               "(use --token-ids or pass --tokenizer)")
        return self._encode(text)

    def decode(self, ids: list[int]) -> str:
        if self._decode is None:
            raise RuntimeError(f"tokenizer {self.name!r} cannot decode")
        return self._decode(ids)

    def candidate_ids(self) -> np.ndarray:
        """Ids to draw prompts from: no special or added tokens and, for text prompts, only
        ids that decode alone to non-empty valid text."""
        if self._candidates is None:
            ids = [i for i in range(self.vocab_size) if i not in self.special_ids]
            if self.can_text:
                texts = self._decode_batch([[i] for i in ids])
                ids = [i for i, t in zip(ids, texts, strict=True) if _clean(t)]
            if not ids:
                raise ValueError(f"tokenizer {self.name!r} has no usable (non-special) tokens")
            self._candidates = np.asarray(ids, dtype=np.int64)
        return self._candidates


def _clean(text: str) -> bool:
    return bool(text.strip()) and "\ufffd" not in text


def load_prompt_tokenizer(path_or_id: str, trust_remote_code: bool = False) -> PromptTokenizer:
    """Load from a local folder or file (tokenizer.json, else transformers when the folder has a
    tokenizer_config.json, else config.json's vocab_size) or from a hub id (transformers)."""
    if path_or_id.startswith(("/", "./", "../", "~")) and not os.path.exists(path_or_id):
        raise ValueError(f"cannot load a tokenizer from {path_or_id!r}: no such path")
    is_dir = os.path.isdir(path_or_id)
    tok_file = os.path.join(path_or_id, "tokenizer.json") if is_dir else path_or_id
    if os.path.isfile(tok_file) and tok_file.endswith(".json"):
        return _from_tokenizers_file(tok_file, name=path_or_id)
    errors = []
    if not is_dir or os.path.isfile(os.path.join(path_or_id, "tokenizer_config.json")):
        try:
            return _from_transformers(path_or_id, trust_remote_code)
        except Exception as e:  # noqa: BLE001 - any failure falls through to the next option
            errors.append(f"transformers: {type(e).__name__}: {e}")
    cfg = os.path.join(path_or_id, "config.json")
    if os.path.isfile(cfg):
        with open(cfg) as f:
            hf = json.load(f)
        special: set[int] = set()
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            val = hf.get(key)
            special.update(int(x) for x in (val if isinstance(val, list) else [val])
                           if x is not None)
        return PromptTokenizer(path_or_id, int(hf["vocab_size"]), special)
    raise ValueError(f"cannot load a tokenizer from {path_or_id!r} (no tokenizer.json, no "
                     f"config.json{'; ' if errors else ''}{'; '.join(errors)}); "
                     "pass --tokenizer PATH")


def _from_tokenizers_file(path: str, name: str) -> PromptTokenizer:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    special = set(tok.get_added_tokens_decoder().keys())
    return PromptTokenizer(
        name, tok.get_vocab_size(with_added_tokens=True), special,
        encode_fn=lambda text: tok.encode(text, add_special_tokens=False).ids,
        decode_fn=lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False),
        decode_batch_fn=lambda seqs: tok.decode_batch(seqs, skip_special_tokens=False))


def _from_transformers(path_or_id: str, trust_remote_code: bool) -> PromptTokenizer:
    from kdaserve.models.tokenizer import get_tokenizer

    tok = get_tokenizer(path_or_id, trust_remote_code)
    special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}).keys())
    return PromptTokenizer(
        path_or_id, len(tok), special,
        encode_fn=lambda text: tok.encode(text, add_special_tokens=False),
        decode_fn=lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False),
        decode_batch_fn=lambda seqs: tok.batch_decode(seqs, skip_special_tokens=False))


# ---------------------------------------------------------------------------------------------
# Prompts


@dataclass
class SyntheticPrompt:
    prompt: str | list[int]
    """Text, or token ids (token-id mode)."""
    prompt_len: int
    """Token count by the client's tokenizer."""


def fit_text(tok: PromptTokenizer, prefix_text: str, ids: list[int], target: int,
             rng: np.random.Generator, max_iters: int = 64) -> tuple[str, int]:
    """Return `prefix_text + decode(ids')` that tokenizes to exactly `target` tokens, where ids'
    is `ids` trimmed or extended with random candidates until the count is exact."""
    cand = tok.candidate_ids()
    ids = list(ids)
    for it in range(max_iters):
        text = prefix_text + tok.decode(ids)
        n = len(tok.encode(text))
        if n == target:
            return text, n
        if n > target:
            ids = ids[:max(len(ids) - (n - target), 0)]
        else:
            ids = ids + rng.choice(cand, target - n).tolist()
        if it >= 8 and ids:
            # Decoded neighbours keep merging the same way: perturb the tail.
            ids[-1] = int(rng.choice(cand))
    raise RuntimeError(f"could not build a prompt of exactly {target} tokens with tokenizer "
                       f"{tok.name!r} after {max_iters} tries")


class PromptFactory:
    """Seeded synthetic prompts of `input_len` tokens, the first `shared_prefix_len` of which are
    the same for every prompt of this factory."""

    def __init__(self, tok: PromptTokenizer, input_len: int, seed: int = 0,
                 shared_prefix_len: int = 0, token_ids: bool = False):
        if input_len < 1:
            raise ValueError(f"input_len must be >= 1, got {input_len}")
        if not 0 <= shared_prefix_len <= input_len:
            raise ValueError(f"shared_prefix_len must be in [0, input_len={input_len}], "
                             f"got {shared_prefix_len}")
        if not token_ids and not tok.can_text:
            raise ValueError(f"tokenizer {tok.name!r} cannot make text prompts: use token ids")
        self.tok = tok
        self.input_len = input_len
        self.seed = seed
        self.shared_prefix_len = shared_prefix_len
        self.token_ids = token_ids
        rng = np.random.default_rng([seed, 0x5EED])
        self.prefix_ids = rng.choice(tok.candidate_ids(), shared_prefix_len).tolist()
        self.prefix_text = ""
        if shared_prefix_len and not token_ids:
            self.prefix_text, _ = fit_text(tok, "", self.prefix_ids, shared_prefix_len, rng)

    def make(self, num: int, stream: int, input_len: int | None = None) -> list[SyntheticPrompt]:
        """`num` distinct prompts; `stream` keys the random stream (e.g. level index and
        warm-up vs measured), so the same call always gives the same prompts. `input_len`
        overrides the factory's length (used to subtract a chat template's tokens)."""
        target = self.input_len if input_len is None else input_len
        if target < max(self.shared_prefix_len, 1):
            raise ValueError(f"prompt length {target} is below the shared prefix "
                             f"({self.shared_prefix_len}) or 1")
        rng = np.random.default_rng([self.seed, stream])
        cand = self.tok.candidate_ids()
        out = []
        for _ in range(num):
            suffix = rng.choice(cand, target - self.shared_prefix_len).tolist()
            if self.token_ids:
                out.append(SyntheticPrompt(self.prefix_ids + suffix, target))
            else:
                text, n = fit_text(self.tok, self.prefix_text, suffix, target, rng)
                out.append(SyntheticPrompt(text, n))
        return out
