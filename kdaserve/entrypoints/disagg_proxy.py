# SPDX-License-Identifier: Apache-2.0
"""`kdaserve proxy --prefill URL [URL...] --decode URL [URL...] --port P`: the front of a
prefill/decode disaggregated deployment.

Each /v1/completions and /v1/chat/completions request goes first to a prefill instance
(round-robin) as a non-streaming request for one token with kv_transfer_params
{"do_remote_decode": true}; the prefill holds the prompt's KV blocks and KDA state and answers
with the kv_transfer_params a decode instance pulls them with. Then the client's own request,
with those kv_transfer_params, goes to a decode instance (round-robin), which returns the whole
answer (the prefill's first token included), streaming or not; its response is passed through.

Errors from either side reach the client as OpenAI error bodies with the instance's status; an
unreachable instance is a 502, one that does not answer in --timeout seconds a 504, and a
stream that breaks ends with an error event, so the proxy never hangs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

logger = logging.getLogger("kdaserve.proxy")

_ROUTES = ("/v1/completions", "/v1/chat/completions")
_HOP_HEADERS = ("authorization",)


def _error(message: str, status: int) -> dict[str, Any]:
    kind = {502: "bad_gateway", 504: "timeout"}.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request as the prefill instance gets it: one token, not streamed, its
    state held for a decode instance."""
    out = dict(body)
    for key in ("stream_options", "max_completion_tokens"):
        out.pop(key, None)
    out.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    if isinstance(out.get("min_tokens"), int):
        out["min_tokens"] = min(out["min_tokens"], 1)
    return out


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout: float) -> None:
        self.prefill, self.decode = list(prefill), list(decode)
        self._next_prefill = itertools.cycle(self.prefill)
        self._next_decode = itertools.cycle(self.decode)
        self.timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        self.client = httpx.AsyncClient(timeout=self.timeout)

    async def close(self) -> None:
        await self.client.aclose()

    def _headers(self, headers) -> dict[str, str]:
        return {k: v for k, v in headers.items() if k.lower() in _HOP_HEADERS}

    async def _post(self, url: str, body: dict, headers: dict) -> tuple[int, Any]:
        """(status, JSON body) of a non-streaming request; transport failures become
        (502 / 504, an OpenAI error body)."""
        try:
            r = await self.client.post(url, json=body, headers=headers)
        except httpx.TimeoutException as e:
            return 504, _error(f"{url} did not answer in time ({type(e).__name__})", 504)
        except httpx.HTTPError as e:
            return 502, _error(f"{url} is unreachable: {type(e).__name__}: {e}", 502)
        try:
            return r.status_code, r.json()
        except ValueError:
            return 502, _error(f"{url} answered {r.status_code} without a JSON body", 502)

    async def handle(self, path: str, body: dict[str, Any], headers) -> tuple[int, Any]:
        """Prefill, then decode. Returns (status, JSON body) or (200, an SSE byte stream)."""
        hdrs = self._headers(headers)
        prefill_url = next(self._next_prefill) + path
        status, pre = await self._post(prefill_url, prefill_body(body), hdrs)
        if status != 200:
            return status, pre
        decode_body = dict(body)
        params = pre.get("kv_transfer_params") if isinstance(pre, dict) else None
        if params:
            decode_body["kv_transfer_params"] = params
        decode_url = next(self._next_decode) + path
        if body.get("stream"):
            return await self._open_stream(decode_url, decode_body, hdrs)
        return await self._post(decode_url, decode_body, hdrs)

    async def _open_stream(self, url: str, body: dict, headers: dict) -> tuple[int, Any]:
        req = self.client.build_request("POST", url, json=body, headers=headers)
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.TimeoutException as e:
            return 504, _error(f"{url} did not answer in time ({type(e).__name__})", 504)
        except httpx.HTTPError as e:
            return 502, _error(f"{url} is unreachable: {type(e).__name__}: {e}", 502)
        if resp.status_code != 200:
            raw = await resp.aread()
            await resp.aclose()
            try:
                return resp.status_code, json.loads(raw)
            except ValueError:
                return 502, _error(f"{url} answered {resp.status_code}", 502)
        return 200, self._relay(url, resp)

    async def _relay(self, url: str, resp) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            err = _error(f"the stream from {url} broke: {type(e).__name__}", 502)
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await resp.aclose()

    async def healthy(self) -> bool:
        for base in self.prefill + self.decode:
            try:
                r = await self.client.get(base + "/health", timeout=5.0)
            except httpx.HTTPError:
                return False
            if r.status_code != 200:
                return False
        return True


def build_app(proxy: Proxy):
    app = FastAPI(title="kdaserve proxy", docs_url=None, redoc_url=None)

    async def route(request: Request):
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return JSONResponse(_error(f"the body is not JSON: {e}", 400), 400)
        if not isinstance(body, dict):
            return JSONResponse(_error("the body must be a JSON object", 400), 400)
        status, result = await proxy.handle(request.url.path, body, request.headers)
        if status == 200 and not isinstance(result, (dict, list)):
            return StreamingResponse(result, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(result, status)

    for path in _ROUTES:
        app.add_api_route(path, route, methods=["POST"])

    @app.get("/health")
    async def health():
        if await proxy.healthy():
            return {"status": "ok"}
        return JSONResponse(_error("an instance behind the proxy is not healthy", 503), 503)

    @app.get("/v1/models")
    async def models(request: Request):
        status, body = await proxy_get(proxy, proxy.decode[0] + "/v1/models", request)
        return JSONResponse(body, status)

    @app.on_event("shutdown")
    async def _close():
        await proxy.close()

    return app


async def proxy_get(proxy: Proxy, url: str, request) -> tuple[int, Any]:
    import httpx

    try:
        r = await proxy.client.get(url, headers=proxy._headers(request.headers))
        return r.status_code, r.json()
    except (httpx.HTTPError, ValueError) as e:
        return 502, _error(f"{url}: {type(e).__name__}: {e}", 502)


def _url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http(s) URL, got {value!r}")
    return value.rstrip("/")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "proxy", help="Front a prefill/decode disaggregated deployment.",
        description="Send each request to a prefill instance for its first token, then to a "
                    "decode instance for the rest (instances started with "
                    "--kv-transfer-config).")
    p.add_argument("--prefill", nargs="+", type=_url, required=True, metavar="URL",
                   help="Prefill instances (kv_producer or kv_both), used round-robin.")
    p.add_argument("--decode", nargs="+", type=_url, required=True, metavar="URL",
                   help="Decode instances (kv_consumer or kv_both), used round-robin.")
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    p.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="Seconds an instance may take to answer (or between two stream "
                        "chunks) before the client gets a 504 (default: %(default)s).")
    p.set_defaults(func=run_proxy)
    return p


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 < args.port < 65536 or args.timeout <= 0:
        print("kdaserve proxy: error: --port must be in 1..65535 and --timeout > 0",
              file=sys.stderr)
        return 2
    app = build_app(Proxy(args.prefill, args.decode, args.timeout))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
