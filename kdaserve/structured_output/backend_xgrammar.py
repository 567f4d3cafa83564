"""The xgrammar backend: the vocabulary xgrammar needs (from the tokenizer folder), grammar
compilation with a cache, and one matcher per request.

A grammar is compiled once per GrammarSpec against the tokenizer (the expensive part: which
tokens each grammar state allows); xgrammar's GrammarCompiler caches compiled grammars by spec,
so requests with the same schema share the work. A `RequestGrammar` wraps one request's
matcher: it accepts the request's tokens as they are sampled, checks draft tokens without
keeping them, and fills the request's rows of a step's token bitmask (bit t of a row set: token
t allowed; int32 words, ceil(vocab_size / 32) per row).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from kdaserve.structured_output.spec import GrammarSpec

CACHE_LIMIT_BYTES = 512 * 2**20
"""Compiled grammars the compiler keeps (vLLM's default xgrammar cache size)."""

BATCH_FILL_MIN_ROWS = 16
"""From this many one-row requests in a step, their rows are filled by xgrammar's threads."""


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's view of `tokenizer`'s vocabulary.

    A Hugging Face tokenizer goes through xgrammar's own detection. Any other is kdaserve's
    tiktoken tokenizer (the Kimi folders ship no tokenizer.json): its convert_ids_to_tokens gives
    byte-level strings (GPT-2's byte map) and `special_tokens` names its added tokens. Those
    enter as empty strings, which xgrammar treats as special: a grammar never emits a control
    token as text; the end-of-sequence token is allowed where the grammar may end."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    added = set(tokenizer.special_tokens.values())
    tokens = tokenizer.convert_ids_to_tokens(range(len(tokenizer)))
    vocab = ["" if i in added else t for i, t in enumerate(tokens)]
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    return xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                             stop_token_ids=stop)


class XgrammarBackend:
    """tokenizer: the model folder's tokenizer (a Hugging Face one, or kdaserve's own tiktoken
    one for the Kimi folders, see `tokenizer_info`); vocab_size: the model's (the logits' width,
    which may exceed the tokenizer's: the extra ids are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: int | None = None) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size)
        self.compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads or min(8, os.cpu_count() or 1),
            cache_enabled=True, cache_limit_bytes=CACHE_LIMIT_BYTES)
        self._batch = None
        """xgrammar BatchGrammarMatcher (made on first use)."""

    def compile(self, spec: GrammarSpec):
        """The xgrammar CompiledGrammar of `spec` (cached by the compiler)."""
        c = self.compiler
        if spec.kind == "json":
            return c.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace)
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "ebnf":
            return c.compile_grammar(spec.text)
        if spec.kind == "lark":
            return c.compile_lark(spec.text)
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def fill_next_rows(self, grammars: list[RequestGrammar], rows: list[int],
                       bitmask: torch.Tensor) -> None:
        """Row rows[i] of `bitmask` <- what grammars[i] (not terminated) allows next; many at
        once on xgrammar's thread pool (the work runs outside the GIL)."""
        if len(grammars) < BATCH_FILL_MIN_ROWS:
            for grammar, row in zip(grammars, rows):
                grammar.matcher.fill_next_token_bitmask(bitmask, row)
            return
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, rows)

    def request_grammar(self, compiled, stop_token_ids: Iterable[int]) -> RequestGrammar:
        """A fresh matcher over `compiled` for one request. stop_token_ids (EOS and the
        request's stop_token_ids) are what the grammar allows once it is complete."""
        return RequestGrammar(compiled, sorted(set(stop_token_ids)), self.vocab_size)


class RequestGrammar:
    """One request's grammar state (xgrammar GrammarMatcher).

    Once the matcher has accepted a stop token it is terminated: its rows then allow only the
    stop tokens (a request that goes on, with ignore_eos or under min_tokens, can only repeat
    them), and further tokens are taken without effect."""

    def __init__(self, compiled, stop_token_ids: list[int], vocab_size: int) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self.stop_token_ids = stop_token_ids
        self.vocab_size = vocab_size
        self._stop_row: torch.Tensor | None = None

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept_tokens(self, token_ids: Iterable[int]) -> bool:
        """Advance over sampled tokens; False at the first one the grammar refuses (the matcher
        stays after the tokens before it)."""
        m = self.matcher
        for tok in token_ids:
            if m.is_terminated():
                return True
            if not m.accept_token(tok):
                return False
        return True

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of `token_ids` the grammar accepts from here (up to and including
        a stop token that completes it); the matcher is left where it was."""
        m = self.matcher
        n = 0
        for tok in token_ids:
            if m.is_terminated() or not m.accept_token(tok):
                break
            n += 1
        if n:
            m.rollback(n)
        return token_ids[:n]

    def fill_rows(self, bitmask: torch.Tensor, row: int, token_ids: list[int]) -> None:
        """Fill rows row .. row + len(token_ids) of `bitmask` ([N, W] int32, host): row + j
        holds what the grammar allows after token_ids[:j] (a spec row's positions: its drafts,
        then the bonus position). The matcher is left where it was."""
        m = self.matcher
        advanced = 0
        following = True
        for j in range(len(token_ids) + 1):
            if m.is_terminated():
                bitmask[row + j].copy_(self.stop_row())
            else:
                m.fill_next_token_bitmask(bitmask, row + j)
            if following and j < len(token_ids) and not m.is_terminated():
                # A draft the grammar refuses (validated drafts never are) leaves the later
                # rows at this state: the sampler rejects that draft, so they are never used.
                following = m.accept_token(token_ids[j])
                advanced += following
        if advanced:
            m.rollback(advanced)

    def stop_row(self) -> torch.Tensor:
        """[W] int32: only the stop tokens allowed."""
        if self._stop_row is None:
            row = torch.zeros(bitmask_width(self.vocab_size), dtype=torch.int64)
            for tok in self.stop_token_ids:
                if 0 <= tok < self.vocab_size:
                    row[tok // 32] |= 1 << (tok % 32)
            # int32 words: bit 31 set is a negative value
            self._stop_row = torch.where(row >= 2**31, row - 2**32, row).to(torch.int32)
        return self._stop_row
