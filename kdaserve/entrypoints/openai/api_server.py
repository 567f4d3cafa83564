# SPDX-License-Identifier: Apache-2.0
"""The HTTP app: routes, error mapping, the request guards (http_guards), disconnect -> abort,
and the OpenAPI document (openapi)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kdaserve import __version__
from kdaserve.engine.async_engine import AsyncEngine, EngineDeadError
from kdaserve.entrypoints.openai.http_guards import GuardMiddleware, HostPolicy, error_response
from kdaserve.entrypoints.openai.json_body import BodyError, parse_json_body
from kdaserve.entrypoints.openai.metrics import ServerMetrics
from kdaserve.entrypoints.openai.openapi import install_openapi
from kdaserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, TokenizeRequest,
                                                  model_card)
from kdaserve.entrypoints.openai.serving_chat import OpenAIServingChat
from kdaserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kdaserve.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    engine: AsyncEngine
    chat: OpenAIServingChat
    completion: OpenAIServingCompletion
    metrics: ServerMetrics
    api_key: str | None = None
    max_request_body_bytes: int = 16 * 1024 * 1024
    hosts: HostPolicy | None = None
    """Host header policy (None: any host)."""


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    try:
        data = parse_json_body(await request.body())
    except BodyError as e:
        raise OpenAIError(str(e)) from e
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from e
    except RecursionError as e:
        raise OpenAIError("the body is nested too deeply") from e


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
    app.add_middleware(GuardMiddleware, api_key=state.api_key,
                       max_body_bytes=state.max_request_body_bytes,
                       hosts=state.hosts or HostPolicy("0.0.0.0", None))
    serving: OpenAIServing = state.completion

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return error_response(OpenAIError(str(exc.detail), exc.status_code,
                                          headers=getattr(exc, "headers", None)))

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError):
        return error_response(OpenAIError("; ".join(str(e.get("msg")) for e in exc.errors())))

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError):
        return error_response(_validation_error(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError):
        return error_response(OpenAIError(str(exc), 503))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        # a server bug: still an OpenAI error body (Starlette logs the traceback)
        return error_response(OpenAIError(f"internal error ({type(exc).__name__})", 500))

    @app.get("/health")
    async def health():
        if state.engine.is_healthy:
            return JSONResponse({"status": "ok"})
        return error_response(OpenAIError("the engine is not running", 503))

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def list_models():
        m = serving.model
        return {"object": "list", "data": [model_card(name, m.served_names[0], m.max_model_len)
                                           for name in m.served_names]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        name = serving.check_model(model_id)
        return model_card(name, serving.model.served_names[0], serving.model.max_model_len)

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
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            built = await _cancel_on_disconnect(request, state.chat.build_prompt(
                [m.to_template_dict() for m in req.messages], tools=tools,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=req.chat_template, kwargs=req.chat_template_kwargs,
                add_special_tokens=bool(req.add_special_tokens)))
            if isinstance(built, Response):
                return built
            ids = built[1]
        else:
            add_special = req.add_special_tokens is not False
            ids = await asyncio.to_thread(serving.encode_prompt, [req.prompt],
                                          add_special_tokens=add_special, param="prompt")
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

    install_openapi(app, serving.model.served_names[0])
    return app
