"""Structured outputs through a real `kdaserve serve` (one tiny server for the module): OpenAI's
response_format (the SDK's `beta.chat.completions.parse` with a pydantic model), vLLM's
structured_outputs and guided_* fields on both endpoints, tool_choice "required" and a named
function, streaming, and bad constraints answered with a 400 that names the field."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from tests.entrypoints.conftest import API_KEY, RemoteServer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSG = [{"role": "user", "content": "hello"}]
TIGHT = {"structured_outputs": {"disable_any_whitespace": True}}
"""No whitespace between JSON tokens: the random model would otherwise pad them for long."""

WEATHER = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["unit", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]


@pytest.fixture(scope="module")
def server(tiny_preset):
    srv = RemoteServer([tiny_preset, "--api-key", API_KEY, "--max-model-len", "512",
                        "--served-model-name", "tiny", "--reasoning-parser", "kimi_k3",
                        "--tool-call-parser", "kimi_k3", "--enable-auto-tool-choice",
                        "--seed", "0"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    happy: bool


def test_sdk_parse_with_a_pydantic_model(client):
    for seed in range(2):
        r = client.beta.chat.completions.parse(model="tiny", messages=MSG, response_format=Pet,
                                               seed=seed, max_tokens=64, extra_body=TIGHT)
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)
        assert Pet.model_validate_json(choice.message.content) == choice.message.parsed


def test_response_format_json_schema_with_any_whitespace(client):
    """The default (vLLM's): whitespace may appear between tokens; a finished output still
    follows the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    finished = 0
    for seed in range(2):
        r = client.chat.completions.create(model="tiny", messages=MSG, seed=seed,
                                           max_tokens=120, response_format=fmt)
        choice = r.choices[0]
        # Constrained output is all content: the reasoning parser leaves it alone.
        assert getattr(choice.message, "reasoning", None) is None
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(choice.message.content), WEATHER)
    assert finished


def _stream_chat(client, **kwargs):
    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(model="tiny", messages=MSG, stream=True,
                                                **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = tc.id or call["id"]
            call["name"] = (tc.function.name if tc.function and tc.function.name
                            else call["name"])
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    return content, [calls[i] for i in sorted(calls)], reasons


def _check_call(name: str, arguments: str):
    args = json.loads(arguments)
    if name == "get_weather":
        jsonschema.validate(args, WEATHER)
    else:
        assert name == "ping" and args == {}


def test_tool_choice_required(client):
    for parallel in (True, False):
        kwargs = dict(seed=5, max_tokens=160, tools=TOOLS, tool_choice="required",
                      parallel_tool_calls=parallel, extra_body=TIGHT)
        r = client.chat.completions.create(model="tiny", messages=MSG, **kwargs)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            _check_call(call.function.name, call.function.arguments)
        if parallel:
            continue
        content, streamed, reasons = _stream_chat(client, **kwargs)
        assert reasons == ["tool_calls"] and not content
        assert [(c["name"], c["arguments"]) for c in streamed] == [
            (c.function.name, c.function.arguments) for c in calls]


def test_named_tool_choice(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(seed=2, max_tokens=64, tools=TOOLS, tool_choice=named, extra_body=TIGHT)
    r = client.chat.completions.create(model="tiny", messages=MSG, **kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"   # OpenAI's (and vLLM's) reason for a named call
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.message.content is None
    _check_call("get_weather", call.function.arguments)
    content, streamed, reasons = _stream_chat(client, **kwargs)
    assert reasons == ["stop"] and not content
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        ("get_weather", call.function.arguments)]


@pytest.mark.parametrize("fields, check", [
    ({"guided_regex": r"[a-c]{2}-\d{2}"}, lambda t: re.fullmatch(r"[a-c]{2}-\d{2}", t)),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_grammar": 'root ::= "<" [a-z] ">"'}, lambda t: re.fullmatch(r"<[a-z]>", t)),
    ({"guided_json": WEATHER, **TIGHT},
     lambda t: jsonschema.validate(json.loads(t), WEATHER) is None),
    ({"structured_outputs": {"regex": r"\d\d"}}, lambda t: re.fullmatch(r"\d\d", t)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "w", "schema": WEATHER}}, **TIGHT},
     lambda t: jsonschema.validate(json.loads(t), WEATHER) is None),
])
def test_completions_constraints(client, fields, check):
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=64, seed=1, n=2,
                                  extra_body=fields)
    for choice in r.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="hi", max_tokens=64, seed=1, stream=True, extra_body=fields)
        if c.choices)
    assert check(streamed), streamed


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"guided_regex": "([a-"}, "guided_regex"),
    ("/v1/completions", {"guided_json": '{"type": '}, "guided_json"),
    ("/v1/completions", {"guided_grammar": "root ::= nowhere"}, "guided_grammar"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/completions", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs"),
    ("/v1/completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("/v1/completions", {"guided_regex": "a", "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, None),
    ("/v1/chat/completions", {"tool_choice": "required"}, None),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objectx"}}}], "tool_choice": "required"}, "tools"),
])
def test_bad_constraints_are_a_400_naming_the_field(server, path, fields, param):
    body = {"model": "tiny", "max_tokens": 4, **fields}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": MSG})
    r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param), err
