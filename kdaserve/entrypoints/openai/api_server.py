# SPDX-License-Identifier: Apache-2.0
"""The HTTP app: routes, error mapping, API-key and body-size guards, disconnect -> abort."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kdaserve import __version__
from kdaserve.engine.async_engine import AsyncEngine, EngineDeadError
from kdaserve.entrypoints.openai.metrics import ServerMetrics
from kdaserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, TokenizeRequest,
                                                  model_card)
from kdaserve.entrypoints.openai.serving_chat import OpenAIServingChat
from kdaserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kdaserve.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing

logger = logging.getLogger(__name__)

_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


@dataclass
class ServerState:
    engine: AsyncEngine
    chat: OpenAIServingChat
    completion: OpenAIServingCompletion
    metrics: ServerMetrics
    api_key: str | None = None
    max_request_body_bytes: int = 16 * 1024 * 1024


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


class _GuardMiddleware:
    """Pure ASGI: API key on /v1 routes, 413 for bodies over the limit (declared or streamed)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        key = self.state.api_key
        if key and path.startswith(_PROTECTED_PREFIXES):
            if headers.get("authorization", "") != f"Bearer {key}":
                return await error_response(OpenAIError(
                    "Unauthorized: missing or wrong API key", 401, code="invalid_api_key"))(
                        scope, receive, send)
        limit = self.state.max_request_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await error_response(OpenAIError(
                f"request body of {declared} bytes exceeds the limit of {limit} bytes", 413))(
                    scope, receive, send)
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


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"invalid JSON body: {e}") from e
    if not isinstance(data, dict):
        raise OpenAIError(f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from e


def _validation_error(e: ValidationError) -> OpenAIError:
    errors = e.errors(include_url=False)
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if not str(x).startswith("function-"))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    first = errors[0].get("loc", ()) if errors else ()
    return OpenAIError("; ".join(parts) or str(e), param=str(first[0]) if first else None)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel_on_disconnect(request: Request, work: Awaitable) -> Any:
    """Run `work`; if the client goes away first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)
    return task.result()


async def _stream_until_disconnect(request: Request,
                                   stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """Forward SSE events; stop (and so abort) the moment the client disconnects.

    The next event is awaited in its own task, raced against the disconnect watcher. On the
    way out that task is cancelled and awaited before the stream is closed (a generator
    running in another task cannot be closed): however the stream ends early (our watcher,
    Starlette's own disconnect listener cancelling us, the generator closed by its
    finalizer), its request is aborted and the server logs one info line, no traceback."""
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    nxt: asyncio.Future | None = None
    ended = False
    try:
        while True:
            nxt = asyncio.ensure_future(anext(stream))
            await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                return
            try:
                item = nxt.result()
            except StopAsyncIteration:
                ended = True
                return
            except BaseException:
                ended = True  # a failure of the stream itself, not a disconnect: raise it
                raise
            nxt = None
            yield item
    finally:
        watcher.cancel()
        if not ended:
            client = request.client
            logger.info("%s %s: the client%s disconnected mid-stream; its request was aborted",
                        request.method, request.url.path,
                        f" {client.host}:{client.port}" if client else "")
        if nxt is not None and not nxt.done():
            # The stream is running inside `nxt`: cancelling it unwinds the stream there
            # (which aborts the request). Awaited when we can, shielded from a cancellation
            # of our own task so that it is not left half-done.
            nxt.cancel()
            await asyncio.gather(asyncio.shield(nxt), return_exceptions=True)
        else:
            await stream.aclose()


def _respond(request: Request, result: Any) -> Response:
    if isinstance(result, Response):
        return result
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(_stream_until_disconnect(request, result),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kdaserve", version=__version__, docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(_GuardMiddleware, state=state)
    serving: OpenAIServing = state.completion

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return error_response(OpenAIError(str(exc.detail), exc.status_code))

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError):
        return error_response(_validation_error(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError):
        return error_response(OpenAIError(str(exc), 503))

    @app.get("/health")
    async def health():
        return Response(status_code=200 if state.engine.is_healthy else 503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def list_models():
        m = serving.model
        return {"object": "list",
                "data": [model_card(name, m.root, m.max_model_len) for name in m.served_names]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        name = serving.check_model(model_id)
        return model_card(name, serving.model.root, serving.model.max_model_len)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, ChatCompletionRequest)
        return _respond(request, await _cancel_on_disconnect(
            request, state.chat.create_chat_completion(req)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        return _respond(request, await _cancel_on_disconnect(
            request, state.completion.create_completion(req)))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await _parse(request, TokenizeRequest)
        serving.check_model(req.model)
        if req.messages is not None:
            _, ids = await asyncio.to_thread(
                state.chat.render_prompt, [m.to_template_dict() for m in req.messages],
                None, req.add_generation_prompt)
        else:
            ids = serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        body = {"count": len(ids), "max_model_len": serving.model.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = serving.tokenizer.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await _parse(request, DetokenizeRequest)
        serving.check_model(req.model)
        serving.check_token_ids(req.tokens, "tokens")
        return {"prompt": serving.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def metrics():
        stats = None
        healthy = state.engine.is_healthy
        if healthy:
            try:
                stats = await state.engine.get_stats()
            except (EngineDeadError, asyncio.TimeoutError):
                healthy = False
        return Response(state.metrics.render(stats, healthy),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
