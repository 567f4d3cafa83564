# SPDX-License-Identifier: Apache-2.0
"""Wire the pieces: engine process -> AsyncEngine -> serving classes -> app -> uvicorn, and
bound the server's lifetime.

- SIGTERM / SIGINT start a graceful shutdown: no new connections, the requests in flight get
  `graceful_shutdown_timeout` seconds to finish; then what still runs is failed (a stream that
  is read ends with an error event) and the connections left (clients that do not read) are
  closed, so the process exits even if a client never reads. Exit status 0.
- The engine-core process dying fails every request in flight (AsyncEngine); the server then
  shuts down at once and exits with status 1, so that a supervisor restarts it (as vLLM does)
  instead of a server that answers 503 forever.

Both knobs come from `--additional-config`: "graceful_shutdown_timeout" (seconds) and
"stream_buffer_limit" (step outputs a request may buffer for a client that does not read
before it is aborted, see AsyncEngine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from typing import Any

import uvicorn

from kdaserve.engine.async_engine import AsyncEngine, EngineStartupError
from kdaserve.entrypoints.openai.api_server import ServerState, build_app
from kdaserve.entrypoints.openai.metrics import ServerMetrics
from kdaserve.entrypoints.openai.reasoning_parser import get_reasoning_parser
from kdaserve.entrypoints.openai.serving_chat import OpenAIServingChat
from kdaserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kdaserve.entrypoints.openai.serving_engine import ModelInfo
from kdaserve.entrypoints.openai.tool_parser import get_tool_parser

logger = logging.getLogger("kdaserve.serve")

GRACEFUL_SHUTDOWN_TIMEOUT_S = 10.0
STREAM_BUFFER_LIMIT = 64
DEAD_ENGINE_GRACE_S = 2.0
"""After the engine died: time for the failed requests' error events to reach their clients."""
_FLUSH_S = 0.5
"""After failing the requests at the graceful timeout: time for their error events to go out
before the connections still open are closed."""


class _Server(uvicorn.Server):
    """uvicorn's server, with what the shutdown needs. uvicorn re-raises SIGTERM/SIGINT after
    its own shutdown, which would kill the process before the engine core is stopped; here the
    signal only starts the graceful shutdown."""

    @contextlib.contextmanager
    def capture_signals(self):
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    @property
    def num_requests_running(self) -> int:
        return len(self.server_state.tasks)

    def close_connections(self) -> int:
        """Abort every connection still open (a client that does not read keeps its response
        blocked in a full send buffer); the response then ends as if the client had gone.
        Returns how many there were."""
        connections = list(self.server_state.connections)
        for connection in connections:
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()
        return len(connections)


def lifecycle_settings(args: argparse.Namespace) -> tuple[float, int]:
    """(graceful_shutdown_timeout, stream_buffer_limit) from --additional-config, or their
    defaults."""
    extra = getattr(args, "additional_config", None) or {}
    return (float(extra.get("graceful_shutdown_timeout", GRACEFUL_SHUTDOWN_TIMEOUT_S)),
            int(extra.get("stream_buffer_limit", STREAM_BUFFER_LIMIT)))


async def _supervise(server: _Server, engine: AsyncEngine, graceful_timeout: float) -> int:
    """Wait until the server is told to stop or the engine dies, then bound the shutdown (see
    the module docstring; a second Ctrl-C, uvicorn's force exit, ends the grace period at
    once). Returns the process's exit status."""
    while not server.should_exit and engine.dead_error is None:
        await asyncio.sleep(0.1)
    status, grace = 0, graceful_timeout
    if not server.should_exit:
        logger.error("the engine is dead: shutting the server down (exit status 1) so that a "
                     "supervisor can restart it")
        server.should_exit = True
        status, grace = 1, min(graceful_timeout, DEAD_ENGINE_GRACE_S)
    start = time.monotonic()
    if not await _wait_requests(server, grace, stop_on_force_exit=True):
        logger.info("graceful shutdown: %d requests still running after %.1f s: failing them",
                    server.num_requests_running, time.monotonic() - start)
        engine.abort_all("the server is shutting down")
        if not await _wait_requests(server, _FLUSH_S):
            logger.info("graceful shutdown: closing %d connections whose clients do not read",
                        server.close_connections())
            await _wait_requests(server, _FLUSH_S)
    return status


async def _wait_requests(server: _Server, timeout: float,
                         stop_on_force_exit: bool = False) -> bool:
    """Wait up to `timeout` s for the requests in flight to end; True if they did."""
    deadline = time.monotonic() + timeout
    while server.num_requests_running:
        if time.monotonic() >= deadline or (stop_on_force_exit and server.force_exit):
            return False
        await asyncio.sleep(0.05)
    return True


def build_state(engine: AsyncEngine, args: argparse.Namespace, model: str,
                chat_template: str | None) -> ServerState:
    info = engine.info
    tokenizer = engine.tokenizer
    vocab_size = int(info.get("vocab_size") or len(tokenizer))
    names = args.served_model_name or [model]
    model_info = ModelInfo(names, model, int(info["max_model_len"]), vocab_size)
    chat = OpenAIServingChat(
        engine, tokenizer, model_info, chat_template=chat_template,
        reasoning_parser_cls=get_reasoning_parser(args.reasoning_parser)
        if args.reasoning_parser else None,
        tool_parser_cls=get_tool_parser(args.tool_call_parser) if args.tool_call_parser else None,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        mirror_reasoning_content=args.mirror_reasoning_content)
    completion = OpenAIServingCompletion(engine, tokenizer, model_info)
    metrics = ServerMetrics(names[0])
    engine.request_observer = metrics.observe
    return ServerState(engine, chat, completion, metrics, args.api_key,
                       args.max_request_body_bytes)


async def serve(args: argparse.Namespace, model: str, engine_kwargs: dict[str, Any],
                chat_template: str | None) -> int:
    """Serve until a signal (status 0) or the engine's death (status 1)."""
    graceful_timeout, stream_buffer_limit = lifecycle_settings(args)
    logger.info("starting the engine for %s", model)
    try:
        engine = await AsyncEngine.start(engine_kwargs, args.engine_startup_timeout,
                                         log_level="INFO",
                                         stream_buffer_limit=stream_buffer_limit)
    except EngineStartupError as e:
        raise ValueError(f"the engine failed to start: {e}") from e
    supervisor = None
    try:
        app = build_app(build_state(engine, args, model, chat_template))
        # uvicorn's own graceful timeout is a backstop only: it cancels the requests, which
        # logs their tracebacks; _supervise ends them cleanly before it. No lifespan: the app
        # has no start-up or shutdown handlers (the engine is started before uvicorn and
        # stopped after it), and a force exit would leave the lifespan task to be cancelled.
        server = _Server(uvicorn.Config(app, host=args.host, port=args.port,
                                        log_level=args.uvicorn_log_level,
                                        access_log=not args.disable_uvicorn_access_log,
                                        timeout_keep_alive=5, lifespan="off",
                                        timeout_graceful_shutdown=graceful_timeout + 5.0))
        supervisor = asyncio.create_task(_supervise(server, engine, graceful_timeout))
        logger.info("serving %s on http://%s:%d (max_model_len=%d)", model, args.host,
                    args.port, engine.info["max_model_len"])
        await server.serve()
        server.should_exit = True  # uvicorn may also stop on its own (a failed start-up)
        status = await supervisor
    finally:
        if supervisor is not None and not supervisor.done():
            supervisor.cancel()
        await engine.shutdown()
    logger.info("server stopped")
    return status
