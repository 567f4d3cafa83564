# SPDX-License-Identifier: Apache-2.0
"""64 concurrent streams, half of which disconnect mid-stream: the rest finish with exact usage,
and afterwards the engine holds nothing (0 running, every KV block and state slot free)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in values:
                values[sample.name] = sample.value
    return values


async def _one(client: httpx.AsyncClient, i: int, disconnect: bool) -> dict:
    payload = {"model": "tiny", "stream": True, "ignore_eos": True,
               "max_tokens": 400 if disconnect else 24, "temperature": 1.0, "seed": i,
               "stream_options": {"include_usage": True}}
    if i % 2:
        path = "/v1/chat/completions"
        payload["messages"] = [{"role": "user", "content": f"request number {i}"}]
    else:
        path = "/v1/completions"
        payload["prompt"] = f"request number {i} says"
    events = []
    async with client.stream("POST", path, json=payload, headers=AUTH) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            events.append(line[6:])
            if disconnect and len(events) >= 3:
                break  # leaving the context closes the connection mid-stream
    return {"i": i, "disconnect": disconnect, "events": events}


def test_64_streams_half_disconnect(server):
    before = scrape(server.url)

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=limits) as client:
            return await asyncio.gather(*(_one(client, i, disconnect=i % 4 < 2)
                                          for i in range(64)))

    results = asyncio.run(main())
    finished = [r for r in results if not r["disconnect"]]
    assert len(finished) == 32
    for r in finished:
        assert r["events"][-1] == "[DONE]"
        usage = json.loads(r["events"][-2])["usage"]
        assert usage["completion_tokens"] == 24
        assert usage["total_tokens"] == usage["prompt_tokens"] + 24
        assert not any('"error"' in e for e in r["events"])

    deadline = time.monotonic() + 30
    while True:
        m = scrape(server.url)
        idle = (m["kdaserve:num_requests_running"] == 0
                and m["kdaserve:num_requests_waiting"] == 0
                and m["kdaserve:num_free_kv_blocks"] == m["kdaserve:num_total_kv_blocks"]
                and m["kdaserve:num_free_state_slots"] == m["kdaserve:num_total_state_slots"])
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert m["kdaserve:num_requests_running"] == 0, m
    assert m["kdaserve:num_requests_waiting"] == 0, m
    assert m["kdaserve:num_free_kv_blocks"] == m["kdaserve:num_total_kv_blocks"], m
    assert m["kdaserve:num_free_state_slots"] == m["kdaserve:num_total_state_slots"], m
    assert m["kdaserve:kv_cache_usage_perc"] == 0.0
    # the 32 disconnected requests were aborted long before their 400 tokens
    generated = m["kdaserve:generation_tokens_total"] - before["kdaserve:generation_tokens_total"]
    assert 32 * 24 <= generated < 32 * 24 + 32 * 200, generated
    assert m["kdaserve:time_to_first_token_seconds_count"] >= \
        before.get("kdaserve:time_to_first_token_seconds_count", 0) + 32
    assert m["kdaserve:engine_healthy"] == 1.0
