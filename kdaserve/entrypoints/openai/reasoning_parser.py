# SPDX-License-Identifier: Apache-2.0
"""Reasoning parsers: split generated text into `reasoning` and `content`.

A parser is a pure function of the cumulative text: `parse(text, final)` returns the reasoning
and content that are safe to show so far. While `final` is False, a tail that could still turn
into a marker (e.g. "</thi") is held back, so both returned strings only ever grow as the text
grows; the streaming layer sends their new suffixes as deltas.
"""

from __future__ import annotations

from dataclasses import dataclass


def held_back_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


@dataclass
class ReasoningSplit:
    reasoning: str
    content: str
    reasoning_ended: bool


class KimiK2ReasoningParser:
    """Kimi K2 / Kimi Linear thinking format: `<think>reasoning</think>content`.

    Reasoning is on when the output starts with `<think>` or the prompt already opened the
    section (the chat template ended it with `<think>`). It ends at `</think>`, or implicitly
    where a tool-call section begins (Kimi may call tools straight out of its thinking).
    """

    start_marker = "<think>"
    end_marker = "</think>"
    implicit_end_markers = ("<|tool_calls_section_begin|>",)

    def __init__(self, prompt_text: str = ""):
        self.starts_in_reasoning = prompt_text.rstrip().endswith(self.start_marker)

    def parse(self, text: str, final: bool) -> ReasoningSplit:
        body = text
        if not self.starts_in_reasoning:
            stripped = text.lstrip()
            if stripped.startswith(self.start_marker):
                body = stripped[len(self.start_marker):]
            elif not final and self.start_marker.startswith(stripped):
                return ReasoningSplit("", "", False)  # may still become "<think>"
            else:
                return ReasoningSplit("", text, True)
        end, end_len = self._find_end(body)
        if end < 0:
            keep = len(body) if final else len(body) - held_back_len(
                body, (self.end_marker, *self.implicit_end_markers))
            return ReasoningSplit(body[:keep], "", False)
        reasoning = body[:end]
        content = body[end + end_len:]
        if end_len:
            content = content.lstrip("\n")
        return ReasoningSplit(reasoning, content, True)

    def _find_end(self, body: str) -> tuple[int, int]:
        """Position and length of the marker that ends reasoning (-1 if none yet).

        An implicit end marker stays part of the content (the tool parser needs it)."""
        hits = [(body.find(self.end_marker), len(self.end_marker))]
        hits += [(body.find(m), 0) for m in self.implicit_end_markers]
        hits = [h for h in hits if h[0] >= 0]
        return min(hits) if hits else (-1, 0)


class KimiK3ReasoningParser:
    """Kimi K3's XTML channels (kimi_k3.md §1.12): the assistant message holds
    `<|open|>think<|sep|>REASONING<|close|>think<|sep|>`, then
    `<|open|>response<|sep|>CONTENT<|close|>response<|sep|>`, then optionally the tools channel
    and `<|close|>message<|sep|>` (`<|end_of_msg|>` ends the turn).

    Reasoning is on when the prompt opened the think channel (the K3 template's generation
    prompt with thinking on) or the output starts with it. It ends at the think channel's
    close, or implicitly where the response or tools channel opens. The content is the rest
    without the channel markers; a tools channel stays in it for the tool parser."""

    think_open = "<|open|>think<|sep|>"
    think_close = "<|close|>think<|sep|>"
    implicit_end_markers = ("<|open|>response<|sep|>", "<|open|>tools<|sep|>")
    dropped_markers = ("<|open|>response<|sep|>", "<|close|>response<|sep|>",
                       "<|close|>message<|sep|>", "<|end_of_msg|>")

    def __init__(self, prompt_text: str = ""):
        self.starts_in_reasoning = prompt_text.endswith(self.think_open)

    def parse(self, text: str, final: bool) -> ReasoningSplit:
        body = text
        if not self.starts_in_reasoning:
            if text.startswith(self.think_open):
                body = text[len(self.think_open):]
            elif not final and self.think_open.startswith(text):
                return ReasoningSplit("", "", False)   # may still become the think channel
            else:
                return ReasoningSplit("", self._content(text, final), True)
        hits = [(body.find(self.think_close), len(self.think_close))]
        hits += [(body.find(m), 0) for m in self.implicit_end_markers]
        hits = [h for h in hits if h[0] >= 0]
        if not hits:
            keep = len(body) if final else len(body) - held_back_len(
                body, (self.think_close, *self.implicit_end_markers))
            return ReasoningSplit(body[:keep], "", False)
        end, end_len = min(hits)
        return ReasoningSplit(body[:end], self._content(body[end + end_len:], final), True)

    def _content(self, text: str, final: bool) -> str:
        for marker in self.dropped_markers:
            text = text.replace(marker, "")
        return text if final else text[:len(text) - held_back_len(text, self.dropped_markers)]


_REASONING_PARSERS = {"kimi_k3": KimiK3ReasoningParser, "kimi_k2": KimiK2ReasoningParser}


def reasoning_parser_names() -> list[str]:
    return sorted(_REASONING_PARSERS)


def get_reasoning_parser(name: str) -> type:
    if name not in _REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; available: {', '.join(reasoning_parser_names())}")
    return _REASONING_PARSERS[name]
