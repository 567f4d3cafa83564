# SPDX-License-Identifier: Apache-2.0
"""The `kimi_k3` parsers against K3's XTML chat format (kimi_k3.md §1.12): think / response
channels and the tools channel, whole text and streamed token by token through kimi-k3-tiny's
tokenizer (the markup tokens are single ids there)."""

from __future__ import annotations

import json

import pytest

from kdaserve.entrypoints.openai.chat_output import ChatOutputState
from kdaserve.entrypoints.openai.reasoning_parser import (KimiK3ReasoningParser,
                                                         get_reasoning_parser)
from kdaserve.entrypoints.openai.tool_parser import KimiK3ToolParser, get_tool_parser
from kdaserve.models.tokenizer import get_tokenizer
from tests.entrypoints.test_parsers import _accumulate, _stream_by_tokens
from tests.models.k3_tiny import k3_tiny_dir  # noqa: F401

PROMPT = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
TOOLS = ('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
         '<|open|>argument key="city" type="string"<|sep|>Paris "centre"<|close|>argument<|sep|>'
         '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
         '<|close|>call<|sep|><|open|>call tool="search" index="2"<|sep|>'
         '<|open|>json type="object"<|sep|>{"q": "kimi k3"}<|close|>json<|sep|>'
         '<|close|>call<|sep|><|close|>tools<|sep|>')
OUTPUT = ("weather first<|close|>think<|sep|><|open|>response<|sep|>I will check."
          "<|close|>response<|sep|>" + TOOLS + "<|close|>message<|sep|>")
CALLS = [("functions.get_weather:0", "get_weather", {"city": 'Paris "centre"', "days": 3}),
         ("functions.search:1", "search", {"q": "kimi k3"})]


@pytest.fixture(scope="module")
def tok(k3_tiny_dir):  # noqa: F811
    return get_tokenizer(k3_tiny_dir)


def test_registry():
    assert get_reasoning_parser("kimi_k3") is KimiK3ReasoningParser
    assert get_tool_parser("kimi_k3") is KimiK3ToolParser


def test_channels_whole_text():
    p = KimiK3ReasoningParser(PROMPT)
    s = p.parse("hmm<|close|>think<|sep|><|open|>response<|sep|>42<|close|>response<|sep|>"
                "<|close|>message<|sep|>", final=True)
    assert (s.reasoning, s.content, s.reasoning_ended) == ("hmm", "42", True)
    # thinking off: the prompt opened the response channel
    off = KimiK3ReasoningParser('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    s = off.parse("42<|close|>response<|sep|>", final=True)
    assert (s.reasoning, s.content) == ("", "42")
    # the output opens the think channel itself
    s = KimiK3ReasoningParser().parse("<|open|>think<|sep|>a<|close|>think<|sep|>b", final=True)
    assert (s.reasoning, s.content) == ("a", "b")
    # straight from thinking to the tools channel
    s = p.parse("plan" + TOOLS, final=True)
    assert s.reasoning == "plan" and s.content == TOOLS
    # unterminated thinking stays reasoning; a partial close marker is held back
    assert p.parse("still", final=True).reasoning == "still"
    assert p.parse("abc<|close|>thi", final=False).reasoning == "abc"


def test_tools_whole_text():
    split = KimiK3ToolParser().parse("I will check." + TOOLS + " done", final=True)
    assert split.content == "I will check. done"
    assert [(c.id, c.name, json.loads(c.arguments)) for c in split.tool_calls] == CALLS
    assert all(c.complete for c in split.tool_calls)
    escaped = KimiK3ToolParser().parse(
        '<|open|>tools<|sep|><|open|>call tool="a&amp;b" index="1"<|sep|><|open|>argument '
        'key="k&quot;" type="boolean"<|sep|>true<|close|>argument<|sep|><|close|>call<|sep|>',
        final=True)
    assert [(c.name, json.loads(c.arguments)) for c in escaped.tool_calls] == [
        ("a&b", {'k"': True})]


def test_streamed_equals_whole_text(tok):
    for marker in ("<|open|>", "<|close|>", "<|sep|>"):
        assert len(tok.encode(marker)) == 1
    streamed = ChatOutputState(KimiK3ReasoningParser(PROMPT), KimiK3ToolParser())
    deltas = _stream_by_tokens(tok, OUTPUT, streamed)
    got = _accumulate(deltas)
    whole = ChatOutputState(KimiK3ReasoningParser(PROMPT), KimiK3ToolParser())
    whole.text = OUTPUT
    msg = whole.message()
    assert got["reasoning"] == msg["reasoning"] == "weather first"
    assert got["content"] == msg["content"] == "I will check."
    calls = [got["tool_calls"][i] for i in sorted(got["tool_calls"])]
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls] == CALLS
    assert [(t["id"], t["function"]["name"], json.loads(t["function"]["arguments"]))
            for t in msg["tool_calls"]] == CALLS
    fragments = [tc for d in deltas for tc in d.get("tool_calls", []) if tc["index"] == 0]
    assert len(fragments) > 1
    assert "<|" not in got["content"] + got["reasoning"]
