# SPDX-License-Identifier: Apache-2.0
"""Reasoning / tool-call parsers of the Kimi K2 format (`kimi_k2`: `<think>`, the tool-call
section; what the Kimi Linear presets' template writes), whole-text and streamed token by token
through the real tiny tokenizer (so markers arrive exactly as the engine's detokenizer would produce them)."""

from __future__ import annotations

import json

import pytest

from kdaserve.entrypoints.openai.chat_output import ChatOutputState
from kdaserve.entrypoints.openai.reasoning_parser import (KimiK2ReasoningParser,
                                                         get_reasoning_parser, held_back_len)
from kdaserve.entrypoints.openai.tool_parser import KimiK2ToolParser, get_tool_parser

TOOL_TEXT = ("I will check.<|tool_calls_section_begin|>"
             "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             '{"city": "Paris", "unit": "c"}<|tool_call_end|>'
             "<|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>"
             '{"q": "kimi linear"}<|tool_call_end|><|tool_calls_section_end|>')


def test_registry_names():
    assert get_reasoning_parser("kimi_k2") is KimiK2ReasoningParser
    assert get_tool_parser("kimi_k2") is KimiK2ToolParser
    with pytest.raises(ValueError, match="unknown reasoning parser 'qwen9'"):
        get_reasoning_parser("qwen9")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_tool_parser("nope")


def test_held_back_len():
    assert held_back_len("abc</th", ("</think>",)) == 4
    assert held_back_len("abc", ("</think>",)) == 0
    assert held_back_len("abc<", ("</think>", "<|x|>")) == 1


def test_reasoning_split_whole_text():
    p = KimiK2ReasoningParser()
    s = p.parse("<think>step one</think>\nThe answer", final=True)
    assert (s.reasoning, s.content) == ("step one", "The answer")
    # no <think>: everything is content
    s = p.parse("plain answer", final=True)
    assert (s.reasoning, s.content) == ("", "plain answer")
    # unterminated reasoning at the end stays reasoning
    s = p.parse("<think>still thinking", final=True)
    assert (s.reasoning, s.content, s.reasoning_ended) == ("still thinking", "", False)
    # the prompt opened the section
    s = KimiK2ReasoningParser("<|im_middle|><think>").parse("hmm</think>ok", final=True)
    assert (s.reasoning, s.content) == ("hmm", "ok")
    # thinking disabled by the template: prompt ends with <think></think>
    s = KimiK2ReasoningParser("<think></think>").parse("ok", final=True)
    assert (s.reasoning, s.content) == ("", "ok")


def test_reasoning_holds_back_partial_markers():
    p = KimiK2ReasoningParser()
    assert p.parse("<thi", final=False).content == ""
    assert p.parse("<think>abc</th", final=False).reasoning == "abc"
    assert p.parse("<think>abc</th", final=True).reasoning == "abc</th"


def test_tool_calls_whole_text():
    split = KimiK2ToolParser().parse(TOOL_TEXT, final=True)
    assert split.content == "I will check."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in split.tool_calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Paris", "unit": "c"}),
        ("functions.search:1", "search", {"q": "kimi linear"})]
    assert all(c.complete for c in split.tool_calls)


def test_tool_call_section_implicitly_ends_reasoning():
    state = ChatOutputState(KimiK2ReasoningParser(), KimiK2ToolParser())
    state.text = "<think>need weather" + TOOL_TEXT[len("I will check."):]
    msg = state.message()
    assert msg["reasoning"] == "need weather" and msg["reasoning_content"] == "need weather"
    assert msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "search"]


def _stream_by_tokens(tokenizer, text: str, state: ChatOutputState) -> list[dict]:
    """Feed `text` as the engine would: one token at a time, as decoded text deltas."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, prev = [], ""
    for n in range(1, len(ids) + 1):
        cur = tokenizer.decode(ids[:n], skip_special_tokens=False)
        if cur.endswith("\ufffd") and n < len(ids):
            continue  # incomplete UTF-8: the detokenizer holds it back too
        delta = state.append(cur[len(prev):], final=n == len(ids))
        prev = cur
        if delta:
            deltas.append(delta)
    return deltas


def _accumulate(deltas: list[dict]) -> dict:
    out = {"reasoning": "", "content": "", "tool_calls": {}}
    for d in deltas:
        assert ("reasoning" in d) == ("reasoning_content" in d)
        out["reasoning"] += d.get("reasoning", "")
        out["content"] += d.get("content", "")
        for tc in d.get("tool_calls", []):
            call = out["tool_calls"].setdefault(tc["index"], {"name": None, "arguments": ""})
            if "id" in tc:
                assert call["name"] is None, "id/name sent twice for one call"
                assert tc["type"] == "function"
                call["id"], call["name"] = tc["id"], tc["function"]["name"]
            call["arguments"] += tc["function"].get("arguments", "")
    return out


def test_marker_tokens_are_single_ids(tokenizer):
    for marker in ("<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                   "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                   "<|tool_calls_section_end|>"):
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1, marker


@pytest.mark.parametrize("with_reasoning", [False, True])
def test_streamed_tool_calls_match_whole_text(tokenizer, with_reasoning):
    text = ("<think>The user wants weather.</think>" if with_reasoning else "") + TOOL_TEXT
    streamed = ChatOutputState(KimiK2ReasoningParser(), KimiK2ToolParser())
    deltas = _stream_by_tokens(tokenizer, text, streamed)
    got = _accumulate(deltas)
    whole = ChatOutputState(KimiK2ReasoningParser(), KimiK2ToolParser())
    whole.text = text
    msg = whole.message()
    assert got["content"] == msg["content"] == "I will check."
    assert got["reasoning"] == (msg["reasoning"] or "")
    assert got["reasoning"] == ("The user wants weather." if with_reasoning else "")
    calls = [got["tool_calls"][i] for i in sorted(got["tool_calls"])]
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls] == [
        (t["id"], t["function"]["name"], json.loads(t["function"]["arguments"]))
        for t in msg["tool_calls"]]
    # arguments really stream: more than one fragment for the first call
    fragments = [tc for d in deltas for tc in d.get("tool_calls", []) if tc["index"] == 0]
    assert len(fragments) > 1
    # no marker text ever leaks into content or reasoning
    assert "<|" not in got["content"] + got["reasoning"] and "think>" not in got["reasoning"]
    assert streamed.has_tool_calls


def test_streamed_plain_content_without_parsers(tokenizer):
    text = "Hello there, <think> is just text here."
    deltas = _stream_by_tokens(tokenizer, text, ChatOutputState(None, None))
    assert "".join(d["content"] for d in deltas) == text


def test_streamed_reasoning_then_content(tokenizer):
    text = "<think>Let me think about it.</think>\n\nThe answer is 42."
    deltas = _stream_by_tokens(tokenizer, text,
                               ChatOutputState(KimiK2ReasoningParser(), None,
                                               mirror_reasoning_content=False))
    got = _accumulate([{**d, "reasoning_content": d["reasoning"]} if "reasoning" in d else d
                       for d in deltas])
    assert got["reasoning"] == "Let me think about it."
    assert got["content"] == "The answer is 42."
    # reasoning deltas all come before content deltas
    kinds = ["r" if "reasoning" in d else "c" for d in deltas]
    assert kinds == sorted(kinds, key=lambda k: k == "c")
    assert all("reasoning_content" not in d for d in deltas)
