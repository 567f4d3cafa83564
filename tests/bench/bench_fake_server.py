# SPDX-License-Identifier: Apache-2.0
"""A small OpenAI-compatible streaming server for testing the bench client (stdlib only).

It streams chunks shaped like vLLM's (role chunk with the first token, one event per step,
continuous usage on every chunk when asked, a usage-only chunk, `[DONE]`) on a known schedule:
`ttft_s` before the first event, `itl_s` between events, `tokens_per_event` tokens per event.
It counts prompt tokens with a real tokenizer (plus `template_tokens` for chat) and records the
peak number of concurrent streams, so tests can check the client against known truth.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class FakeServerConfig:
    model: str = "fake-model"
    root: str | None = None
    """Reported as data[0].root of /v1/models (the tokenizer folder)."""
    ttft_s: float = 0.05
    itl_s: float = 0.01
    tokens_per_event: int = 1
    template_tokens: int = 7
    """Tokens a chat template adds around the user message."""
    encode: object = None
    """Callable text -> list[int], for usage.prompt_tokens."""


@dataclass
class FakeServerState:
    active: int = 0
    peak_active: int = 0
    bodies: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeOpenAIServer

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _json(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        cfg = self.server.cfg
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{
                "id": cfg.model, "object": "model", "created": 0, "owned_by": "kdaserve",
                "root": cfg.root, "parent": None, "max_model_len": 65536, "permission": []}]})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            self._json(404, {"error": {"message": f"no route {self.path}"}})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state = self.server.state
        with state.lock:
            state.bodies.append(body)
        if body.get("fake_fail") == "http":
            self._json(500, {"error": {"message": "injected failure"}})
            return
        with state.lock:
            state.active += 1
            state.peak_active = max(state.peak_active, state.active)
        try:
            self._stream(body, chat=self.path == "/v1/chat/completions")
        finally:
            with state.lock:
                state.active -= 1

    def _send_event(self, obj: dict | str) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        payload = f"data: {data}\n\n".encode()
        self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
        self.wfile.flush()

    def _stream(self, body: dict, chat: bool) -> None:
        cfg = self.server.cfg
        if chat:
            prompt_tokens = len(cfg.encode(body["messages"][-1]["content"])) + cfg.template_tokens
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        else:
            p = body["prompt"]
            prompt_tokens = len(p) if isinstance(p, list) else len(cfg.encode(p))
            max_tokens = body.get("max_tokens") or 16
        n_out = max_tokens if body.get("ignore_eos") else max(1, max_tokens // 2)
        opts = body.get("stream_options") or {}
        continuous = bool(opts.get("continuous_usage_stats"))

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(choice: dict, done: int) -> dict:
            c = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else
                 "text_completion", "created": 0, "model": cfg.model, "choices": [choice]}
            if continuous:
                c["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                              "total_tokens": prompt_tokens + done}
            return c

        time.sleep(cfg.ttft_s)
        if chat:  # the role chunk goes out with the first token, as vLLM does
            self._send_event(chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}, 0))
        done = 0
        while done < n_out:
            if done:
                time.sleep(cfg.itl_s)
            if done >= n_out // 2 and body.get("fake_fail") == "stream":
                self._send_event({"error": {"message": "injected mid-stream failure"}})
                break
            k = min(cfg.tokens_per_event, n_out - done)
            done += k
            text = " tok" * k
            finish = None if done < n_out else ("length" if body.get("ignore_eos") else "stop")
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                      else {"index": 0, "text": text, "finish_reason": finish})
            self._send_event(chunk(choice, done))
        if opts.get("include_usage") and body.get("fake_fail") != "stream":
            self._send_event({"id": "cmpl-1", "object": "chat.completion.chunk", "created": 0,
                              "model": cfg.model, "choices": [], "usage": {
                                  "prompt_tokens": prompt_tokens, "completion_tokens": done,
                                  "total_tokens": prompt_tokens + done}})
        self._send_event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class FakeOpenAIServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, cfg: FakeServerConfig):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.cfg = cfg
        self.state = FakeServerState()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()
