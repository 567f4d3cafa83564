"""Incremental detokenisation with stop strings.

Text is decoded over a sliding window of token ids (prefix_offset..end, vLLM's prefix/read offset
scheme): decoding a few already-emitted tokens as context keeps tokenizers that strip or merge
spaces at a sequence start (SentencePiece) right, and a window whose text ends in U+FFFD is held
back because the last character's bytes are not all there yet. Stop strings are matched on the
decoded text; while streaming, the last `max(len(stop)) - 1` characters are held back so text that
turns out to start a stop string is never emitted.
"""

from __future__ import annotations

from typing import Any, Sequence

from tokenizers import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
_INITIAL_CONTEXT_TOKENS = 5
"""Prompt tokens decoded as context before the first output token."""


class IncrementalDetokenizer:
    """Turns one sample's output token ids into text, a delta at a time.

    tokenizer: any HF tokenizer (PreTrainedTokenizerFast or slow); only `decode` and `len()` are
    used. Ids outside [0, len(tokenizer)) (padded model vocab) are kept in `token_ids` but render
    as nothing.

    Use: `delta, stop = d.append(ids)` after each step; when the request ends for another reason
    (EOS, stop token, length, abort) call `d.flush()` once for the held-back tail.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        stop = list(stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.tokenizer = tokenizer
        # Fast tokenizers: call the Rust backend directly (what their decode does without the
        # clean-up, minus the Python wrapping per call; two calls per token per step).
        backend = getattr(tokenizer, "_tokenizer", None)
        self._fast_decode = backend.decode if isinstance(backend, Tokenizer) else None
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self._vocab_size = len(tokenizer)

        self.token_ids: list[int] = []
        """Output token ids as appended (including undecodable ones)."""
        self.stop_reason: str | None = None
        """The stop string that ended the output, once one matched."""

        # Decodable ids of prompt + output; the window [prefix_offset, len) is decoded each step.
        self._ids = [t for t in prompt_token_ids if self._decodable(t)]
        self._prefix_offset = max(len(self._ids) - _INITIAL_CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        self._text = ""  # all complete text decoded so far (before stop truncation)
        self.output_text = ""
        """Full text so far (cut at the stop string once one matched; the stop string itself is
        kept only with include_stop_str_in_output). May run ahead of the emitted deltas."""
        self._num_emitted = 0  # chars of output_text already returned as deltas
        self._stop_hold = 0 if include_stop_str_in_output or not stop else \
            max(len(s) for s in stop) - 1

    def append(self, new_token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Add sampled tokens. Returns (text newly safe to emit, matched stop string or None).
        Once a stop string matched the output is final: the delta carries all remaining text."""
        if self.stop_reason is not None:
            raise ValueError(f"append({list(new_token_ids)!r}) after the output already stopped "
                             f"on stop string {self.stop_reason!r}")
        for tok in new_token_ids:
            tok = int(tok)
            self.token_ids.append(tok)
            if self._decodable(tok):
                self._ids.append(tok)
        return self._advance(final=False), self.stop_reason

    def flush(self) -> str:
        """Emit everything held back (an incomplete trailing character renders as U+FFFD, as a
        full decode would). Call once when the request finishes without a stop string."""
        if self.stop_reason is not None:
            return ""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prev_len = len(self._text)
        self._text += self._decode_window(final)
        self.output_text = self._text
        matched = self._find_stop(prev_len)
        if matched is not None:
            stop, idx = matched
            self.stop_reason = stop
            cut = idx + len(stop) if self.include_stop_str_in_output else idx
            self.output_text = self._text[:cut]
            final = True
        end = len(self.output_text) if final else len(self.output_text) - self._stop_hold
        if end <= self._num_emitted:
            return ""
        delta = self.output_text[self._num_emitted:end]
        self._num_emitted = end
        return delta

    def _decode_window(self, final: bool) -> str:
        """New complete text since the last call; advances the offsets when some was found."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) and not final:
            return ""  # e.g. only skipped special tokens so far
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""  # the last character's bytes are still arriving
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def _find_stop(self, prev_len: int) -> tuple[str, int] | None:
        """Earliest stop string ending in the text added after prev_len, as (stop, start)."""
        best: tuple[str, int] | None = None
        for stop in self.stop:
            idx = self._text.find(stop, max(prev_len - len(stop) + 1, 0))
            if idx != -1 and (best is None or idx < best[1]):
                best = (stop, idx)
        return best

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=self.skip_special_tokens)
        # No clean-up: it rewrites text across token boundaries, which breaks delta prefixes.
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decodable(self, tok: int) -> bool:
        return 0 <= tok < self._vocab_size
