# SPDX-License-Identifier: Apache-2.0
"""Bad input never gets a 5xx: each case is a 4xx with an OpenAI error body, and the server
keeps serving afterwards."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, BODY_LIMIT, MAX_MODEL_LEN

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def chat(**fields):
    return {"model": "tiny", "messages": MSG, "max_tokens": 2, **fields}


def comp(**fields):
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields}


# (id, method, path, json body or raw bytes, headers, expected status)
CASES = [
    ("invalid_json", "POST", CHAT, b'{"model": "tiny", "messages": [', AUTH, 400),
    ("body_not_object", "POST", CHAT, b"[1, 2, 3]", AUTH, 400),
    ("messages_string", "POST", CHAT, chat(messages="hello"), AUTH, 400),
    ("messages_empty", "POST", CHAT, chat(messages=[]), AUTH, 400),
    ("messages_missing", "POST", CHAT, {"model": "tiny"}, AUTH, 400),
    ("message_no_role", "POST", CHAT, chat(messages=[{"content": "x"}]), AUTH, 400),
    ("message_bad_role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]),
     AUTH, 400),
    ("image_part", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), AUTH, 400),
    ("max_tokens_negative", "POST", CHAT, chat(max_tokens=-5), AUTH, 400),
    ("max_tokens_zero", "POST", COMP, comp(max_tokens=0), AUTH, 400),
    ("max_tokens_huge", "POST", CHAT, chat(max_tokens=10**9), AUTH, 400),
    ("max_completion_tokens_huge", "POST", CHAT, chat(max_completion_tokens=MAX_MODEL_LEN),
     AUTH, 400),
    ("max_tokens_string", "POST", CHAT, chat(max_tokens="lots"), AUTH, 400),
    ("temperature_negative", "POST", CHAT, chat(temperature=-0.5), AUTH, 400),
    ("temperature_string", "POST", COMP, comp(temperature="hot"), AUTH, 400),
    ("top_p_zero", "POST", CHAT, chat(top_p=0), AUTH, 400),
    ("top_p_above_one", "POST", COMP, comp(top_p=1.5), AUTH, 400),
    ("top_k_bad", "POST", COMP, comp(top_k=-7), AUTH, 400),
    ("min_p_bad", "POST", COMP, comp(min_p=2.0), AUTH, 400),
    ("n_zero", "POST", CHAT, chat(n=0), AUTH, 400),
    ("n_huge", "POST", CHAT, chat(n=10_000), AUTH, 400),
    ("min_tokens_over_max", "POST", COMP, comp(min_tokens=10, max_tokens=2), AUTH, 400),
    ("seed_negative", "POST", COMP, comp(seed=-1), AUTH, 400),
    ("unknown_model", "POST", CHAT, chat(model="gpt-17"), AUTH, 404),
    ("missing_api_key", "POST", CHAT, chat(), {}, 401),
    ("wrong_api_key", "POST", COMP, comp(), {"Authorization": "Bearer nope"}, 401),
    ("oversized_body", "POST", COMP, comp(prompt="x" * (BODY_LIMIT + 10)), AUTH, 413),
    ("chat_prompt_too_long", "POST", CHAT,
     chat(messages=[{"role": "user", "content": "word " * (MAX_MODEL_LEN * 2)}]), AUTH, 400),
    ("completion_ids_too_long", "POST", COMP, comp(prompt=[5] * MAX_MODEL_LEN), AUTH, 400),
    ("top_logprobs_too_many", "POST", CHAT, chat(logprobs=True, top_logprobs=50), AUTH, 400),
    ("top_logprobs_without_logprobs", "POST", CHAT, chat(top_logprobs=2), AUTH, 400),
    ("logprobs_wrong_type", "POST", CHAT, chat(logprobs="yes please"), AUTH, 400),
    ("completion_logprobs_too_many", "POST", COMP, comp(logprobs=30), AUTH, 400),
    ("stop_int", "POST", CHAT, chat(stop=42), AUTH, 400),
    ("stop_list_with_int", "POST", COMP, comp(stop=["a", 3]), AUTH, 400),
    ("stop_empty_string", "POST", COMP, comp(stop=[""]), AUTH, 400),
    ("prompt_missing", "POST", COMP, {"model": "tiny", "max_tokens": 2}, AUTH, 400),
    ("prompt_empty_list", "POST", COMP, comp(prompt=[]), AUTH, 400),
    ("prompt_empty_string", "POST", COMP, comp(prompt=""), AUTH, 400),
    ("prompt_token_out_of_vocab", "POST", COMP, comp(prompt=[1, 2, 10**8]), AUTH, 400),
    ("prompt_token_negative", "POST", COMP, comp(prompt=[1, -2]), AUTH, 400),
    ("prompt_wrong_type", "POST", COMP, comp(prompt={"text": "hi"}), AUTH, 400),
    ("stop_token_ids_out_of_vocab", "POST", COMP, comp(stop_token_ids=[10**8]), AUTH, 400),
    ("stream_options_without_stream", "POST", CHAT,
     chat(stream_options={"include_usage": True}), AUTH, 400),
    ("presence_penalty_out_of_range", "POST", CHAT, chat(presence_penalty=2.5), AUTH, 400),
    ("frequency_penalty_out_of_range", "POST", COMP, comp(frequency_penalty=-3), AUTH, 400),
    ("repetition_penalty_zero", "POST", CHAT, chat(repetition_penalty=0), AUTH, 400),
    ("logit_bias_key_not_a_token", "POST", CHAT, chat(logit_bias={"abc": 1}), AUTH, 400),
    ("logit_bias_value_out_of_range", "POST", COMP, comp(logit_bias={"5": 101}), AUTH, 400),
    ("logit_bias_out_of_vocab", "POST", CHAT, chat(logit_bias={"100000000": 5}), AUTH, 400),
    ("tool_choice_names_unknown_function", "POST", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice={"type": "function", "function": {"name": "g"}}), AUTH, 400),
    ("tool_choice_required_without_tools", "POST", CHAT, chat(tool_choice="required"),
     AUTH, 400),
    ("guided_regex_invalid", "POST", COMP, comp(guided_regex="([a-"), AUTH, 400),
    ("tools_malformed", "POST", CHAT, chat(tools=[{"type": "function"}]), AUTH, 400),
    ("response_format_json_schema", "POST", CHAT,
     chat(response_format={"type": "json_schema"}), AUTH, 400),
    ("tokenize_nothing", "POST", "/tokenize", {"model": "tiny"}, AUTH, 400),
    ("detokenize_out_of_vocab", "POST", "/detokenize", {"tokens": [10**8]}, AUTH, 400),
    ("unknown_route", "POST", "/v1/embeddings_and_more", chat(), AUTH, 404),
    ("wrong_method", "GET", CHAT, None, AUTH, 405),
    ("unknown_model_card", "GET", "/v1/models/nope", None, AUTH, 404),
]


def _send(server, method, path, body, headers):
    kwargs = {"headers": headers, "timeout": 60}
    if isinstance(body, bytes):
        kwargs["content"] = body
        kwargs["headers"] = {**headers, "Content-Type": "application/json"}
    elif body is not None:
        kwargs["json"] = body
    return httpx.request(method, server.url + path, **kwargs)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_openai_4xx(server, case):
    _, method, path, body, headers, status = case
    r = _send(server, method, path, body, headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]


def test_streamed_oversized_body_without_length_is_413(server):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 4):
            yield b"x" * 1024
        yield b'", "max_tokens": 1}'

    r = httpx.post(server.url + COMP, content=chunks(),
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["message"]


def test_unknown_fields_are_ignored(server):
    r = _send(server, "POST", CHAT, chat(frobnicate=True, metadata={"a": 1}, user="u",
                                         stream_options=None, parallel_tool_calls=False),
              AUTH)
    assert r.status_code == 200, r.text
    r = _send(server, "POST", COMP, comp(some_future_field=[1, 2]), AUTH)
    assert r.status_code == 200, r.text


def test_server_still_serves_after_the_matrix(server):
    for case in CASES[:5]:
        _send(server, *case[1:5])
    assert httpx.get(server.url + "/health").status_code == 200
    r = _send(server, "POST", CHAT, chat(max_tokens=3, stream=True), AUTH)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
