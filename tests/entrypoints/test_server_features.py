"""Prefix caching and speculative decoding through the HTTP server: cached_tokens in usage,
cache_salt isolation, spec-decode counters on /metrics, output unchanged by speculation."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, RemoteServer

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def feature_server(tiny_model):
    # the tiny model drafts for itself: every draft is proposed and (greedy) accepted
    spec = json.dumps({"method": "draft_model", "model": tiny_model,
                       "num_speculative_tokens": 3})
    srv = RemoteServer([tiny_model, "--api-key", API_KEY, "--max-model-len", "1024",
                        "--block-size", "16",
                        "--optimization-config", '{"kda_checkpoint_interval": 64}',
                        "--speculative-config", spec, "--seed", "0"])
    yield srv
    srv.stop()


def complete(srv, prompt_ids, **extra):
    body = {"model": srv_model(srv), "prompt": prompt_ids, "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, **extra}
    r = httpx.post(srv.url + "/v1/completions", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def srv_model(srv) -> str:
    return httpx.get(srv.url + "/v1/models", headers=HEADERS).json()["data"][0]["id"]


def metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", headers=HEADERS).text
    m = re.search(rf"^kdaserve:{name}(?:_total)?\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_prefix_hit_reported_in_usage(feature_server):
    prefix = [(7 * i + 11) % 2900 + 50 for i in range(200)]
    first = complete(feature_server, prefix + [60, 61, 62])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = complete(feature_server, prefix + [70, 71])
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 192
    assert second["usage"]["prompt_tokens"] == 202
    other_salt = complete(feature_server, prefix + [70, 71], cache_salt="tenant-x")
    assert other_salt["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other_salt["choices"][0]["text"] == second["choices"][0]["text"]
    assert metric(feature_server, "prefix_cache_hits") >= 192


def test_spec_decoding_is_lossless_and_counted(feature_server, tiny_model):
    prompt = [101, 102, 103, 104, 105] * 12
    drafted = metric(feature_server, "spec_decode_num_draft_tokens")
    accepted = metric(feature_server, "spec_decode_num_accepted_tokens")
    out = complete(feature_server, prompt, max_tokens=24)
    assert out["usage"]["completion_tokens"] == 24
    new_drafts = metric(feature_server, "spec_decode_num_draft_tokens") - drafted
    assert new_drafts > 0
    assert metric(feature_server, "spec_decode_num_accepted_tokens") - accepted == new_drafts
    assert metric(feature_server, "spec_decode_num_drafts") > 0
    assert metric(feature_server, "spec_decode_kda_state_bytes_written") > 0
    # the same request without speculation (offline engine, same model) gives the same text
    from kdaserve import LLM, SamplingParams

    llm = LLM(tiny_model, max_model_len=1024, enable_prefix_caching=False)
    ref = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out["choices"][0]["text"] == ref.outputs[0].text


def test_penalties_and_logit_bias_over_http(feature_server):
    """logit_bias (string token ids, OpenAI style) and the penalties reach the sampler through
    the speculating server: +100 forces a token, -100 bans the plain first token, and strong
    penalties give a run without repeats."""
    prompt = [5, 6, 7, 8] * 3
    ids = complete(feature_server, prompt, logit_bias={"77": 100}, return_token_ids=True)
    assert ids["choices"][0]["token_ids"] == [77] * 12
    plain = complete(feature_server, prompt, return_token_ids=True)["choices"][0]["token_ids"]
    banned = complete(feature_server, prompt, return_token_ids=True,
                      logit_bias={str(plain[0]): -100})["choices"][0]["token_ids"]
    assert banned[0] != plain[0]
    spread = complete(feature_server, prompt, return_token_ids=True, frequency_penalty=2.0,
                      presence_penalty=2.0, repetition_penalty=1.5)["choices"][0]["token_ids"]
    assert len(set(spread)) == len(spread) and not set(spread) & set(prompt)
