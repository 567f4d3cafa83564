# SPDX-License-Identifier: Apache-2.0
"""What every HTTP request passes before routing, in this order:

1. Host: only allowed host names (a loopback server accepts only loopback names), so that a web
   page cannot reach it through DNS rebinding (its Host header is the attacker's domain);
2. API key: `Authorization: Bearer KEY` on every route but /health (compared in constant time);
3. Content-Type: a request body must be JSON, so that a cross-site form or `text/plain` fetch
   (which a browser sends without asking the server first) is refused;
4. size: bodies over the limit get 413, whether declared by Content-Length or streamed.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable

from fastapi.responses import JSONResponse

from kdaserve.entrypoints.openai.serving_engine import OpenAIError

OPEN_PATHS = frozenset({"/health"})
"""Paths served without the API key (liveness probes)."""

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower().rstrip(".")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The host of a Host header value ("name:port", "[v6]:port"), lowercased."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostPolicy:
    """allowed: host names the Host header may carry ("*" = any); None: loopback names only when
    the server listens on a loopback address, else any."""

    def __init__(self, bind_host: str, allowed: Iterable[str] | None):
        self.any = False
        self.names: set[str] = set()
        self.loopback = False
        if allowed is None:
            self.loopback = is_loopback(bind_host)
            self.any = not self.loopback
        else:
            names = {host_name(h) for h in allowed}
            self.any = "*" in names
            self.names = names

    def allows(self, header: str | None) -> bool:
        if self.any or header is None:
            return True
        name = host_name(header).rstrip(".")
        if self.loopback:
            return is_loopback(name)
        return name in self.names


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


class GuardMiddleware:
    """Pure ASGI middleware enforcing the module's four checks."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, hosts: HostPolicy):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.hosts = hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        error = self._check(scope, headers)
        if error is not None:
            return await error_response(error)(scope, receive, send)
        limit = self.max_body_bytes
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise OpenAIError(f"request body exceeds the limit of {limit} bytes", 413)
            return message

        await self.app(scope, limited_receive, send)

    def _check(self, scope, headers: dict[str, bytes]) -> OpenAIError | None:
        host = headers.get("host")
        if not self.hosts.allows(None if host is None else host.decode("latin-1")):
            return OpenAIError("this server does not answer for that Host header (allowed "
                               "hosts: the additional-config key allowed_hosts)",
                               code="invalid_host")
        path = scope.get("path", "")
        if self.api_key is not None and path not in OPEN_PATHS:
            given = headers.get("authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.api_key):
                return OpenAIError("Unauthorized: missing or wrong API key", 401,
                                   code="invalid_api_key")
        declared = headers.get("content-length")
        has_body = (declared not in (None, b"0")) or b"chunked" in headers.get(
            "transfer-encoding", b"").lower()
        if has_body and scope.get("method") in ("POST", "PUT", "PATCH"):
            content_type = headers.get("content-type", b"").decode("latin-1")
            if not _is_json(content_type):
                return OpenAIError(f"the request body must be JSON (Content-Type: "
                                   f"application/json), got {content_type or 'no Content-Type'}",
                                   415, code="unsupported_media_type")
        if declared is not None:
            try:
                size = int(declared.decode("latin-1"))
            except ValueError:
                return OpenAIError("invalid Content-Length header")
            if size > self.max_body_bytes:
                return OpenAIError(f"request body of {size} bytes exceeds the limit of "
                                   f"{self.max_body_bytes} bytes", 413)
        return None
