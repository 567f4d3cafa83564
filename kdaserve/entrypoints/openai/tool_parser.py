# SPDX-License-Identifier: Apache-2.0
"""Tool-call parsers: turn a model's tool-call text into OpenAI `tool_calls`.

Like the reasoning parsers, `parse(text, final)` is a pure function of the cumulative text and
returns only what is safe to show: content and argument strings grow monotonically while the
text grows, so the streaming layer can send their new suffixes as indexed deltas. Besides the
model's own format (Kimi), two parsers read the JSON that tool_choice "required" or a named
function constrains the output to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kdaserve.entrypoints.openai.reasoning_parser import held_back_len


@dataclass
class ParsedToolCall:
    id: str
    """Kimi's own call id, `functions.NAME:IDX`; its chat template renders tool results by it."""
    name: str
    arguments: str
    complete: bool


@dataclass
class ToolSplit:
    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class KimiK3ToolParser:
    """Kimi K2/K3 tool-call format (all markers are special tokens of the Kimi tokenizer):

    <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>
      ...
    <|tool_calls_section_end|>
    """

    section_begin = "<|tool_calls_section_begin|>"
    section_end = "<|tool_calls_section_end|>"
    call_begin = "<|tool_call_begin|>"
    argument_begin = "<|tool_call_argument_begin|>"
    call_end = "<|tool_call_end|>"

    def parse(self, text: str, final: bool) -> ToolSplit:
        start = text.find(self.section_begin)
        if start < 0:
            keep = len(text) if final else len(text) - held_back_len(text, (self.section_begin,))
            return ToolSplit(text[:keep])
        content = text[:start]
        section = text[start + len(self.section_begin):]
        end = section.find(self.section_end)
        if end >= 0:
            content += section[end + len(self.section_end):]
            section, final = section[:end], True
        return ToolSplit(content, self._parse_calls(section, final))

    def _parse_calls(self, section: str, final: bool) -> list[ParsedToolCall]:
        calls = []
        pos = 0
        while True:
            begin = section.find(self.call_begin, pos)
            if begin < 0:
                return calls
            head_start = begin + len(self.call_begin)
            arg = section.find(self.argument_begin, head_start)
            if arg < 0:
                return calls  # the call id is not complete yet
            call_id = section[head_start:arg].strip()
            args_start = arg + len(self.argument_begin)
            stop = section.find(self.call_end, args_start)
            if stop >= 0:
                calls.append(ParsedToolCall(call_id, _function_name(call_id),
                                            section[args_start:stop].lstrip(), True))
                pos = stop + len(self.call_end)
                continue
            args = section[args_start:]
            if not final:
                args = args[:len(args) - held_back_len(args, (self.call_end, self.section_end))]
            calls.append(ParsedToolCall(call_id, _function_name(call_id), args.lstrip(), final))
            return calls


def _function_name(call_id: str) -> str:
    """`functions.get_weather:0` -> `get_weather`."""
    name = call_id.rsplit(":", 1)[0] if ":" in call_id else call_id
    return name.split(".", 1)[1] if name.startswith("functions.") else name


class NamedToolCallParser:
    """tool_choice naming a function: the whole (grammar-constrained) output is that function's
    arguments object, streamed as it grows."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> ToolSplit:
        if not text and not final:
            return ToolSplit("")
        return ToolSplit("", [ParsedToolCall(f"functions.{self.name}:0", self.name, text,
                                             final)])


class RequiredToolCallParser:
    """tool_choice "required": the (grammar-constrained) output is a JSON array of
    {"name", "parameters"} objects. Each call is shown once its object is complete; output that
    is no such array by the end (cut by max_tokens) stays content."""

    _decoder = json.JSONDecoder()

    def parse(self, text: str, final: bool) -> ToolSplit:
        calls = []
        pos = _skip_ws(text, 0)
        if text.startswith("[", pos):
            pos += 1
            while True:
                pos = _skip_ws(text, pos)
                try:
                    item, pos = self._decoder.raw_decode(text, pos)
                except json.JSONDecodeError:
                    break
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    break
                args = json.dumps(item.get("parameters") or {}, ensure_ascii=False)
                calls.append(ParsedToolCall(f"functions.{item['name']}:{len(calls)}",
                                            item["name"], args, True))
                pos = _skip_ws(text, pos)
                if not text.startswith(",", pos):
                    break
                pos += 1
        return ToolSplit(text if final and not calls else "", calls)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


_TOOL_PARSERS = {"kimi_k3": KimiK3ToolParser, "kimi_k2": KimiK3ToolParser}


def tool_parser_names() -> list[str]:
    return sorted(_TOOL_PARSERS)


def get_tool_parser(name: str) -> type[KimiK3ToolParser]:
    if name not in _TOOL_PARSERS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; available: {', '.join(tool_parser_names())}")
    return _TOOL_PARSERS[name]
