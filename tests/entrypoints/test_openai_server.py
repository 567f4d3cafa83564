# SPDX-License-Identifier: Apache-2.0
"""The OpenAI API end to end: a real `kdaserve serve` (tiny model, CPU) driven by the openai SDK
and by raw httpx for the SSE framing."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, MAX_MODEL_LEN

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about linear attention."}]


def chat_prompt_len(tokenizer, messages, **kwargs) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **kwargs)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_models_health_version(server, tiny_model):
    models = server.client().models.list()
    ids = [m.id for m in models.data]
    assert ids == [tiny_model, "tiny"]
    raw = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    card = raw.json()["data"][0]
    assert card["root"] == tiny_model and card["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.url + "/health").status_code == 200
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(server.url + "/version", headers=auth).json()["version"]


def test_chat_non_streaming_usage(server, tokenizer):
    r = server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=7,
                                                extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == "tiny"
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == chat_prompt_len(tokenizer, MESSAGES)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_streaming_matches_non_streaming(server):
    client = server.client()
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    # role chunk first, then content, finish chunk, then the usage chunk
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    message = full.choices[0].message
    assert text == (message.content or "")
    finish = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finish[-1] == "length" and all(f is None for f in finish[:-1])
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # one event per engine step: (12 tokens -> at most 12 content events + role chunk)
    assert 2 <= len(chunks) - 1 <= 13


def test_chat_n2_and_seeds(server):
    client = server.client()
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=1.0,
                  extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kwargs, seed=1234, n=2)
    b = client.chat.completions.create(**kwargs, seed=1234, n=2)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 20
    texts = {client.chat.completions.create(**kwargs, seed=s).choices[0].message.content
             for s in (1, 2, 3)}
    assert len(texts) > 1, "different seeds should give different samples"


def test_chat_n2_streaming(server):
    chunks = list(server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, n=2, seed=7, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    for index in (0, 1):
        mine = [c for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].choices[0].delta.role == "assistant"
        assert mine[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12
    # continuous usage: every chunk carries a running count that never decreases
    running = [c.usage.completion_tokens for c in chunks]
    assert running == sorted(running)


def test_stop_strings(server):
    client = server.client()
    base = client.completions.create(model="tiny", prompt="The cache holds", max_tokens=24,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[5:8] if len(text) >= 8 else None
    if not stop or not stop.strip():
        pytest.skip(f"greedy output too short/blank to pick a stop string: {text!r}")
    r = client.completions.create(model="tiny", prompt="The cache holds", max_tokens=24,
                                  temperature=0.0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].model_extra.get("stop_reason") == stop


def test_completions_prompt_shapes_and_usage(server, tokenizer):
    client = server.client()
    ids = tokenizer.encode("hello world", add_special_tokens=True)
    one = client.completions.create(model="tiny", prompt="hello world", max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert one.usage.prompt_tokens == len(ids) and one.usage.completion_tokens == 5
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == one.choices[0].text
    many = client.completions.create(model="tiny", prompt=["hello world", "a b c"],
                                     max_tokens=3, n=2, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    assert many.usage.completion_tokens == 12
    assert many.usage.prompt_tokens == len(ids) + len(tokenizer.encode("a b c"))
    lists = client.completions.create(model="tiny", prompt=[ids, ids[:2]], max_tokens=2,
                                      extra_body={"ignore_eos": True})
    assert len(lists.choices) == 2 and lists.usage.prompt_tokens == len(ids) + 2


def test_completions_streaming_and_echo(server):
    client = server.client()
    full = client.completions.create(model="tiny", prompt="Once", max_tokens=8, temperature=0,
                                     echo=True, extra_body={"ignore_eos": True})
    assert full.choices[0].text.startswith("Once")
    chunks = list(client.completions.create(
        model="tiny", prompt="Once", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].object == "text_completion"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert "Once" + text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_logprobs(server):
    client = server.client()
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                       logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5 == r.usage.completion_tokens
    assert len(r.choices[0].model_extra["token_ids"]) == 5
    for entry in content:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob <= tops[0] + 1e-5
    c = client.completions.create(model="tiny", prompt="Once", max_tokens=4, logprobs=2,
                                  temperature=0, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    # greedy: the sampled token is the most likely one
    for tok_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and abs(tok_lp - max(top.values())) < 1e-4
    assert "".join(lp.tokens) == c.choices[0].text


def test_reasoning_split_through_server(server):
    # The prompt opens the thinking section, so the (random) output is reasoning.
    messages = [{"role": "user", "content": "Think first."},
                {"role": "assistant", "content": "<think>"}]
    client = server.client()
    body = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, seed=3,
                                       temperature=0, extra_body=body)
    msg = r.choices[0].message
    reasoning = msg.model_extra["reasoning"]
    assert reasoning and msg.model_extra["reasoning_content"] == reasoning
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                 temperature=0, extra_body=body, stream=True))
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning") or ""
                       for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if "</think>" not in reasoning:
        assert streamed == reasoning and msg.content in (None, "") and content == ""


def test_tool_round_trip_input(server, tokenizer):
    """A conversation with a tool call and its result renders through the Kimi template."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                 "function": {"name": "get_weather",
                                              "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "21C"}]
    r = server.client().chat.completions.create(model="tiny", messages=messages, tools=tools,
                                                max_tokens=3, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason in ("length", "tool_calls", "stop")
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    assert "## Return of functions.get_weather:0" in text
    assert r.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_tokenize_detokenize(server, tokenizer):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"}, headers=headers)
    ids = tokenizer.encode("hello world", add_special_tokens=True)
    assert r.json()["tokens"] == ids and r.json()["count"] == len(ids)
    r = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, headers=headers)
    assert r.json()["count"] == chat_prompt_len(tokenizer, MESSAGES)
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=headers)
    assert r.json()["prompt"] == tokenizer.decode(ids)


def _sse_events(body: str) -> list[str]:
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    for e in events:
        assert e.startswith("data: "), e
    return [e[len("data: "):] for e in events]


def test_raw_sse_framing_role_with_first_token(server):
    payload = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "stream": True,
               "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=payload,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = "".join(r.iter_text())
    events = _sse_events(body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # the role chunk is sent when the first token exists: the next event carries that token
    assert chunks[1]["choices"][0]["delta"].get("content") is not None
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "usage" not in chunks[1]


def test_prompt_over_max_model_len_is_400_and_server_lives(server):
    client = server.client()
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5] * (MAX_MODEL_LEN + 1), max_tokens=1)
    assert "maximum context length" in str(e.value)
    ok = client.completions.create(model="tiny", prompt="still alive", max_tokens=2)
    assert ok.usage.completion_tokens >= 1
