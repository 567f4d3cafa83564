# SPDX-License-Identifier: Apache-2.0
"""Per-choice chat output state: raw generated text -> message (final) or deltas (streaming).

The pipeline is text -> reasoning parser -> tool parser. Both parsers are pure functions of the
cumulative text, so a delta is the difference between what they return now and what was sent.
"""

from __future__ import annotations

from typing import Any

from kdaserve.entrypoints.openai.reasoning_parser import KimiK3ReasoningParser
from kdaserve.entrypoints.openai.tool_parser import KimiK3ToolParser


class ChatOutputState:
    def __init__(self, reasoning_parser: KimiK3ReasoningParser | None,
                 tool_parser: KimiK3ToolParser | None, mirror_reasoning_content: bool = True):
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.mirror = mirror_reasoning_content
        self.text = ""
        # What has been sent so far (streaming).
        self.sent_reasoning = 0
        self.sent_content = 0
        self.sent_args: list[int] = []

    @property
    def plain(self) -> bool:
        return self.reasoning_parser is None and self.tool_parser is None

    def _split(self, final: bool):
        reasoning, content = "", self.text
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.parse(self.text, final)
            reasoning, content = split.reasoning, split.content
        calls = []
        if self.tool_parser is not None:
            tools = self.tool_parser.parse(content, final)
            content, calls = tools.content, tools.tool_calls
        return reasoning, content, calls

    def append(self, delta_text: str, final: bool) -> dict[str, Any] | None:
        """Feed new text; return the delta message to stream, or None if nothing to show yet."""
        self.text += delta_text
        if self.plain:
            return {"content": delta_text} if delta_text else None
        reasoning, content, calls = self._split(final)
        delta: dict[str, Any] = {}
        if len(reasoning) > self.sent_reasoning:
            delta["reasoning"] = reasoning[self.sent_reasoning:]
            if self.mirror:
                delta["reasoning_content"] = delta["reasoning"]
            self.sent_reasoning = len(reasoning)
        if len(content) > self.sent_content:
            delta["content"] = content[self.sent_content:]
            self.sent_content = len(content)
        tool_deltas = []
        for i, call in enumerate(calls):
            if i == len(self.sent_args):
                tool_deltas.append({"index": i, "id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": call.arguments}})
                self.sent_args.append(len(call.arguments))
            elif len(call.arguments) > self.sent_args[i]:
                tool_deltas.append({"index": i,
                                    "function": {"arguments": call.arguments[self.sent_args[i]:]}})
                self.sent_args[i] = len(call.arguments)
        if tool_deltas:
            delta["tool_calls"] = tool_deltas
        return delta or None

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.sent_args)

    def message(self) -> dict[str, Any]:
        """The complete assistant message for a non-streaming response."""
        if self.plain:
            return {"role": "assistant", "content": self.text}
        reasoning, content, calls = self._split(final=True)
        msg: dict[str, Any] = {"role": "assistant",
                               "content": content or (None if calls or reasoning else "")}
        if self.reasoning_parser is not None:
            msg["reasoning"] = reasoning or None
            if self.mirror:
                msg["reasoning_content"] = msg["reasoning"]
        if calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
            self.sent_args = [len(c.arguments) for c in calls]
        return msg
