# SPDX-License-Identifier: Apache-2.0
"""Tool-call parsers: turn a model's tool-call text into OpenAI `tool_calls`.

Like the reasoning parsers, `parse(text, final)` is a pure function of the cumulative text and
returns only what is safe to show: content and argument strings grow monotonically while the
text grows, so the streaming layer can send their new suffixes as indexed deltas. Besides the
models' own formats (kimi_k2, kimi_k3), two parsers read the JSON that tool_choice "required"
or a named function constrains the output to.
"""

from __future__ import annotations

import html
import json
import re
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


class _SectionToolParser:
    """A parser for formats that put the calls in one delimited section: the text before it
    (and after its end) is content; a partial section marker at the end of streamed text is
    held back. Subclasses give the markers and `_parse_calls` (the section's calls so far)."""

    section_begin: str
    section_end: str

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
        raise NotImplementedError


class KimiK2ToolParser(_SectionToolParser):
    """Kimi K2 / Kimi Linear tool-call format (all markers are special tokens of the Kimi tokenizer):

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


_TAG_RE = re.compile(r'<\|open\|>(call|argument|json)((?: [\w-]+="[^"]*")*)<\|sep\|>')
_ATTR_RE = re.compile(r'([\w-]+)="([^"]*)"')


class KimiK3ToolParser(_SectionToolParser):
    """Kimi K3's XTML tools channel (kimi_k3.md §1.12):

    <|open|>tools<|sep|>
      <|open|>call tool="NAME" index="1"<|sep|>
        <|open|>argument key="K" type="string"<|sep|>RAW<|close|>argument<|sep|> ...
      <|close|>call<|sep|> ...
    <|close|>tools<|sep|>

    A string argument is its raw text; other types (number, boolean, null, object, array) are
    JSON. A call may instead hold one `<|open|>json type="object"<|sep|>{...}<|close|>json
    <|sep|>`. Attribute values are XML-escaped. The arguments come out as a JSON object
    string that only grows while the call streams; ids are `functions.NAME:I` (I counts the
    calls of the section from 0).
    """

    section_begin = "<|open|>tools<|sep|>"
    section_end = "<|close|>tools<|sep|>"
    call_end = "<|close|>call<|sep|>"

    def _parse_calls(self, section: str, final: bool) -> list[ParsedToolCall]:
        calls, pos = [], 0
        while (m := _TAG_RE.search(section, pos)) is not None:
            if m[1] != "call":
                pos = m.end()
                continue
            name = html.unescape(dict(_ATTR_RE.findall(m[2])).get("tool", ""))
            stop = section.find(self.call_end, m.end())
            body = section[m.end():] if stop < 0 else section[m.end():stop]
            complete = stop >= 0 or final
            calls.append(ParsedToolCall(f"functions.{name}:{len(calls)}", name,
                                        _arguments(body, complete), complete))
            if stop < 0:
                break
            pos = stop + len(self.call_end)
        return calls


def _arguments(body: str, complete: bool) -> str:
    """The JSON arguments of one call body so far (a prefix of the final string)."""
    out, pos, kind = "", 0, None
    while (m := _TAG_RE.search(body, pos)) is not None and m[1] != "call":
        attrs = {k: html.unescape(v) for k, v in _ATTR_RE.findall(m[2])}
        close = f"<|close|>{m[1]}<|sep|>"
        stop = body.find(close, m.end())
        value = body[m.end():] if stop < 0 else body[m.end():stop]
        if stop < 0 and not complete:
            value = value[:len(value) - held_back_len(value, (close,))]
        done = stop >= 0 or complete
        if m[1] == "json":
            out, kind = value, "json"
        else:
            out += ("{" if kind is None else ", ") + json.dumps(attrs.get("key", "")) + ": "
            kind = "args"
            if attrs.get("type", "string") == "string":
                out += json.dumps(value) if done else json.dumps(value)[:-1]
            else:
                out += value
        if stop < 0:
            return out + ("}" if complete and kind == "args" else "")
        pos = stop + len(close)
    if not complete:
        return out
    return out + "}" if kind == "args" else (out or "{}")


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


_TOOL_PARSERS = {"kimi_k3": KimiK3ToolParser, "kimi_k2": KimiK2ToolParser}


def tool_parser_names() -> list[str]:
    return sorted(_TOOL_PARSERS)


def get_tool_parser(name: str) -> type:
    if name not in _TOOL_PARSERS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; available: {', '.join(tool_parser_names())}")
    return _TOOL_PARSERS[name]
