# SPDX-License-Identifier: Apache-2.0
"""Prompt text -> token ids with work bounded by the context length: a prompt too long for the
model is refused before it is tokenized whole, and truncation tokenizes only the part it keeps.

A prompt is a list of text pieces tokenized one by one and concatenated (the chat path cuts the
rendered template where user text must not join its neighbours, see chat_utils). Two bounds,
both exact (they never refuse a prompt that fits):

- characters: no token covers more than `max_token_chars` characters (the longest vocabulary
  entry), so a text longer than max_model_len * max_token_chars characters cannot fit;
- a chunked count, for tokenizers whose splitting is local (a fast tokenizer without a
  normalizer whose pre-tokenizer is byte-level / regex splitting, as the Kimi and GPT families
  use): a long piece is tokenized in chunks cut before a single space between two non-space
  characters, which every such pre-tokenizer splits at, so the chunks' counts add up to the
  piece's. Counting stops as soon as it passes the limit.

Only a prompt under both bounds is tokenized whole, so a refused request costs about as much as
the longest prompt that fits, whatever its size in bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

CHUNK_CHARS = 64 * 1024
"""Characters per chunk of the chunked count (before moving the cut to a split point)."""

_SPLIT_WINDOW = 4096
"""How far a cut may move to reach a split point; a piece without one there is counted whole."""

_SPLIT_POINT = re.compile(r"(?<=\S) (?=\S)")


class PromptTooLongError(ValueError):
    """The prompt has at least `num_tokens` tokens (a lower bound when `exact` is False), which
    is not less than `limit`."""

    def __init__(self, num_tokens: int, limit: int, exact: bool):
        self.num_tokens = num_tokens
        self.limit = limit
        self.exact = exact
        super().__init__(f"the prompt has {'' if exact else 'more than '}{num_tokens} tokens; "
                         f"the limit is {limit}")


_PROBE = ("Hello, world! It's 2024-06-01: x=3.14; y = [1, 2, 3]. \u4f60\u597d\u4e16\u754c "
          "na\u00efve caf\u00e9  --  a\tb\nc \"q\" (p) {k: v} <tag> e-mail@host.org 12345678")


def _local_splitting(tokenizer: Any) -> bool:
    """Whether cutting a text before ' x' (after a non-space) changes no token: a fast
    tokenizer without a normalizer whose pre-tokenizer is only byte-level / isolated regex
    splitting, no added token that holds a space or strips its neighbours' whitespace, and the
    chunked count equal to the whole count on a probe text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return False
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer")
    except (ValueError, AttributeError):
        return False
    parts = (pre.get("pretokenizers", [pre]) if pre else [])
    if not parts or any(p.get("type") not in ("ByteLevel", "Split") for p in parts):
        return False
    if any(p.get("type") == "Split" and p.get("behavior") != "Isolated" for p in parts):
        return False
    for t in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if (" " in str(t) or getattr(t, "lstrip", False) or getattr(t, "rstrip", False)
                or getattr(t, "single_word", False)):
            return False
    whole = len(tokenizer.encode(_PROBE, add_special_tokens=False))
    cuts = [0] + [m.start() for m in _SPLIT_POINT.finditer(_PROBE)] + [len(_PROBE)]
    chunked = sum(len(tokenizer.encode(_PROBE[a:b], add_special_tokens=False))
                  for a, b in zip(cuts, cuts[1:]))
    return whole == chunked


class PromptTokenizer:
    """tokenizer: the HF tokenizer; max_model_len: the context length a prompt must stay under.

    encode() raises PromptTooLongError for a prompt of max_model_len tokens or more (the caller
    turns it into its context-length error) and ValueError for truncate values out of range."""

    def __init__(self, tokenizer: Any, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        vocab = tokenizer.get_vocab()
        added = [str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
        self.max_token_chars = max([len(k) for k in vocab] + [len(t) for t in added] + [1])
        """An upper bound on the characters one token covers: the longest vocabulary entry
        (byte-level entries are at least as long as their text)."""
        self.local_splitting = _local_splitting(tokenizer)
        self._specials = tokenizer.encode("", add_special_tokens=True)

    # ---------------------------------------------------------------------------- the bounds

    def _count_at_least(self, piece: str, stop_above: int) -> int:
        """Tokens of `piece`, counted in chunks; stops (returning the partial count) once it
        exceeds stop_above."""
        count, start = 0, 0
        while start < len(piece):
            end = self._cut(piece, start + CHUNK_CHARS)
            count += len(self.tokenizer.encode(piece[start:end], add_special_tokens=False))
            if count > stop_above:
                return count
            start = end
        return count

    @staticmethod
    def _cut(piece: str, pos: int) -> int:
        """A split point at or after pos (the piece's end if none is near)."""
        if pos >= len(piece):
            return len(piece)
        m = _SPLIT_POINT.search(piece, pos, min(len(piece), pos + _SPLIT_WINDOW))
        return m.start() if m else len(piece)

    def check_length(self, pieces: Sequence[str], add_special_tokens: bool) -> None:
        """Refuse a prompt that cannot fit, without tokenizing it whole."""
        limit = self.max_model_len
        specials = len(self._specials) if add_special_tokens else 0
        chars = sum(len(p) for p in pieces)
        if chars > limit * self.max_token_chars:
            raise PromptTooLongError(-(-chars // self.max_token_chars) + specials, limit, False)
        if not self.local_splitting or chars <= 4 * limit:
            return
        count = specials
        for piece in pieces:
            count += self._count_at_least(piece, limit - count)
            if count >= limit:
                raise PromptTooLongError(count, limit, False)

    # ------------------------------------------------------------------------------ encoding

    def encode(self, pieces: Sequence[str], *, add_special_tokens: bool,
               truncate: int | None = None, side: str = "left") -> list[int]:
        """Token ids of the pieces, concatenated (the tokenizer's special tokens first when
        add_special_tokens). truncate: vLLM's truncate_prompt_tokens (-1 = max_model_len),
        keeping the last (side "left") or first ("right") that many tokens."""
        specials = list(self._specials) if add_special_tokens else []
        if truncate is None:
            self.check_length(pieces, add_special_tokens)
            return specials + self._encode_all(pieces)
        keep = self.max_model_len if truncate == -1 else truncate
        if keep > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens={truncate} is greater than max_model_len="
                             f"{self.max_model_len}; request a smaller truncation size")
        body = max(keep - len(specials), 0)
        if body == 0:
            return specials[:keep]
        kept = self._truncated_pieces(pieces, body, side)
        ids = self._encode_all(kept)
        return specials + (ids[-body:] if side == "left" else ids[:body])

    def _encode_all(self, pieces: Sequence[str]) -> list[int]:
        ids: list[int] = []
        for piece in pieces:
            if piece:
                ids.extend(self.tokenizer.encode(piece, add_special_tokens=False))
        return ids

    def _truncated_pieces(self, pieces: Sequence[str], keep: int, side: str) -> list[str]:
        """The part of the prompt that holds the `keep` tokens truncation keeps: enough
        characters for keep + 1 tokens on that side, cut at a split point; the whole prompt for
        tokenizers without local splitting."""
        if not self.local_splitting:
            return list(pieces)
        budget = (keep + 1) * self.max_token_chars + _SPLIT_WINDOW
        ordered = list(pieces) if side == "right" else list(reversed(pieces))
        kept: list[str] = []
        for piece in ordered:
            if len(piece) < budget:
                kept.append(piece)
                budget -= len(piece)
                continue
            if side == "right":
                end = self._cut(piece, budget - _SPLIT_WINDOW)
                kept.append(piece[:end])
            else:
                start = len(piece) - budget
                m = _SPLIT_POINT.search(piece, start, start + _SPLIT_WINDOW)
                kept.append(piece[m.start():] if m else piece)
            break
        return kept if side == "right" else list(reversed(kept))
