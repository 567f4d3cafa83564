# SPDX-License-Identifier: Apache-2.0
"""`kdaserve serve` on kimi-k3-tiny (CPU): the Kimi tiktoken tokenizer in the API process, the
XTML chat template with thinking / thinking_effort, the kimi_k3 parsers on the think / response
channels, and the server's greedy completions equal the offline engine's."""

from __future__ import annotations

import httpx
import pytest

from kdaserve import SamplingParams
from kdaserve.models.tokenizer import get_tokenizer
from tests.entrypoints.conftest import API_KEY, RemoteServer
from tests.models.k3_tiny import k3_tiny_dir, one_torch_thread  # noqa: F401

PROMPT = [17, 230, 5, 991, 41, 41, 2000, 7, 88]


@pytest.fixture(scope="module")
def k3_server(k3_tiny_dir):  # noqa: F811
    srv = RemoteServer([k3_tiny_dir, "--api-key", API_KEY, "--max-model-len", "512",
                        "--max-num-seqs", "8", "--served-model-name", "k3", "--seed", "0",
                        "--reasoning-parser", "kimi_k3", "--tool-call-parser", "kimi_k3",
                        "--enable-auto-tool-choice"])
    yield srv
    srv.stop()


def test_completion_greedy_equals_offline(k3_server, k3_tiny_dir):  # noqa: F811
    from kdaserve import LLM

    r = k3_server.client().completions.create(model="k3", prompt=PROMPT, max_tokens=8,
                                              temperature=0.0, extra_body={"ignore_eos": True})
    llm = LLM(k3_tiny_dir, max_model_len=512, num_gpu_blocks=64)
    want = llm.generate([{"prompt_token_ids": PROMPT}],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == 8


def test_chat_uses_the_xtml_template(k3_server, k3_tiny_dir):  # noqa: F811
    tok = get_tokenizer(k3_tiny_dir)
    messages = [{"role": "user", "content": "Hello there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    r = httpx.post(k3_server.url + "/tokenize", json={"messages": messages},
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.json()["tokens"] == tok.encode(text)
    for kwargs in ({}, {"thinking": False}, {"thinking_effort": "low"}):
        r = k3_server.client().chat.completions.create(
            model="k3", messages=messages, max_tokens=3,
            extra_body={"ignore_eos": True, "chat_template_kwargs": kwargs})
        want = tok.encode(tok.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True, **kwargs))
        assert r.usage.prompt_tokens == len(want), kwargs
        assert r.usage.completion_tokens == 3


def test_kimi_k3_parsers_split_the_channels(k3_server):
    """The random model never closes a channel: thinking on, the output is reasoning; thinking
    off (the prompt opened the response channel), it is content."""
    messages = [{"role": "user", "content": "Think first."}]
    client = k3_server.client()
    r = client.chat.completions.create(model="k3", messages=messages, max_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
    msg = r.choices[0].message
    assert msg.model_extra["reasoning"] and not msg.content
    r = client.chat.completions.create(
        model="k3", messages=messages, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking": False}})
    msg = r.choices[0].message
    assert msg.content and not msg.model_extra.get("reasoning")


def test_images_are_refused_with_a_clear_error(k3_server):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    r = httpx.post(k3_server.url + "/v1/chat/completions",
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "k3", "messages": messages, "max_tokens": 2})
    assert r.status_code == 400     # the request validation refuses it, before the template
    assert "image_url" in r.json()["error"]["message"]
    assert k3_server.client().models.list().data       # the server lives on
