# SPDX-License-Identifier: Apache-2.0
"""Streaming OpenAI-compatible client: one request -> one `RequestRecord`.

Timing follows `vllm bench serve`: `start` = `time.perf_counter()` just before the POST; every
SSE event with non-empty `choices` is timestamped on arrival; usage is taken from whichever chunk
carries it (last wins).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from kdaserve.bench.metrics import RequestRecord

_EOL = re.compile(r"\r\n|\r|\n")

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class RequestConfig:
    """What every request of a run shares."""

    base_url: str
    model: str
    endpoint: str = "chat"
    """chat | completions."""
    output_len: int = 128
    temperature: float | None = None
    top_p: float | None = None
    ignore_eos: bool = True
    api_key: str | None = None
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, "
                             f"got {self.endpoint!r}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        self.base_url = self.base_url.rstrip("/").removesuffix("/v1")

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINT_PATHS[self.endpoint]

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def body(self, prompt: str | list[int], max_tokens: int | None = None) -> dict:
        max_tokens = self.output_len if max_tokens is None else max_tokens
        body: dict = {"model": self.model, "stream": True,
                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if self.endpoint == "chat":
            if not isinstance(prompt, str):
                raise ValueError("token-id prompts need the completions endpoint")
            body["messages"] = [{"role": "user", "content": prompt}]
            # Both names: OpenAI's current one and the older one some servers still read.
            body["max_completion_tokens"] = max_tokens
            body["max_tokens"] = max_tokens
        else:
            body["prompt"] = prompt
            body["max_tokens"] = max_tokens
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.top_p is not None:
            body["top_p"] = self.top_p
        body.update(self.extra_body)
        return body


def _choice_text(choice: dict) -> str:
    delta = choice.get("delta")
    if delta is None:  # completions
        return choice.get("text") or ""
    text = delta.get("content") or ""
    text += delta.get("reasoning") or delta.get("reasoning_content") or ""
    for call in delta.get("tool_calls") or []:
        fn = call.get("function") or {}
        text += (fn.get("name") or "") + (fn.get("arguments") or "")
    return text


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Lines of a server-sent event stream. SSE ends a line only at CR, LF or CRLF; httpx's
    `aiter_lines` also splits at U+0085, U+2028, U+2029 and the other `str.splitlines`
    separators, which JSON leaves unescaped inside a generated token's text."""
    buf = ""
    async for chunk in chunks:
        buf += chunk
        # A CR at the end may be the first half of a CRLF: keep it for the next chunk.
        end = len(buf) - 1 if buf.endswith("\r") else len(buf)
        start = 0
        while (m := _EOL.search(buf, start, end)) is not None:
            yield buf[start:m.start()]
            start = m.end()
        buf = buf[start:]
    if buf.rstrip("\r"):
        yield buf.rstrip("\r")


async def send_request(client: httpx.AsyncClient, cfg: RequestConfig, req_id: str,
                       prompt: str | list[int], prompt_len: int, t0: float,
                       max_tokens: int | None = None) -> RequestRecord:
    """Stream one request. Never raises for server or transport failures: they become
    `success=False` with `error` set."""
    max_tokens = cfg.output_len if max_tokens is None else max_tokens
    rec = RequestRecord(req_id=req_id, prompt_len=prompt_len, expected_output_len=max_tokens)
    body = cfg.body(prompt, max_tokens)
    last_completion_tokens = 0
    chars = 0
    st = time.perf_counter()
    rec.start = st - t0
    try:
        async with client.stream("POST", cfg.url, json=body, headers=cfg.headers()) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:500]}"
                return rec
            async for line in sse_lines(resp.aiter_text()):
                now = time.perf_counter() - st
                line = line.strip()
                if not line or line.startswith(":") or not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if data.get("error"):
                    rec.error = f"stream error: {json.dumps(data['error'])[:500]}"
                    return rec
                usage = data.get("usage")
                choices = data.get("choices")
                if choices:
                    rec.event_times.append(now)
                    if usage and usage.get("completion_tokens") is not None:
                        n = int(usage["completion_tokens"])
                        rec.event_tokens.append(n - last_completion_tokens)
                        last_completion_tokens = n
                    text = "".join(_choice_text(c) for c in choices)
                    if text:
                        chars += len(text)
                        rec.num_text_events += 1
                        rec.last_text_time = now
                        if rec.first_text_time is None:
                            rec.first_text_time = now
                    for c in choices:
                        if c.get("finish_reason"):
                            rec.finish_reason = c["finish_reason"]
                if usage:
                    if usage.get("prompt_tokens") is not None:
                        rec.prompt_tokens = int(usage["prompt_tokens"])
                    if usage.get("completion_tokens") is not None:
                        rec.output_tokens = int(usage["completion_tokens"])
                        rec.output_tokens_source = "usage"
        rec.request_end = time.perf_counter() - st
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    rec.generated_chars = chars
    if not rec.event_times:
        rec.error = "stream ended without any choices event"
        return rec
    if len(rec.event_tokens) != len(rec.event_times):
        rec.event_tokens = []  # the server did not report running usage on every event
    rec.ttft = rec.event_times[0]
    rec.latency = rec.event_times[-1]
    if rec.output_tokens is None:
        # No usage: count events that carried text (vLLM re-tokenizes; we have no text kept).
        rec.output_tokens = rec.num_text_events
        rec.output_tokens_source = "events"
    rec.success = True
    return rec


def make_client(timeout: float, max_connections: int) -> httpx.AsyncClient:
    # trust_env=False: benchmark traffic goes straight to the server, never via a proxy.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)),
        limits=httpx.Limits(max_connections=max_connections,
                            max_keepalive_connections=max_connections),
        trust_env=False)


async def get_models(client: httpx.AsyncClient, base_url: str,
                     api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
    resp.raise_for_status()
    return resp.json()


def wait_for_health(base_url: str, timeout: float, proc=None, poll: float = 1.0) -> float:
    """Block until GET /health answers 200; return the seconds waited. Raises TimeoutError, or
    RuntimeError when `proc` (a Popen) exits first."""
    t_begin = time.monotonic()
    url = base_url.rstrip("/") + "/health"
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode} before /health "
                                   "answered")
            try:
                if client.get(url).status_code == 200:
                    return time.monotonic() - t_begin
            except httpx.HTTPError:
                pass
            if time.monotonic() - t_begin > timeout:
                raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")
            time.sleep(poll)
