# SPDX-License-Identifier: Apache-2.0
"""Wire the pieces: engine process -> AsyncEngine -> serving classes -> app -> uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
from typing import Any

import uvicorn

from kdaserve.engine.async_engine import AsyncEngine, EngineStartupError
from kdaserve.entrypoints.openai.api_server import ServerState, build_app
from kdaserve.entrypoints.openai.cli_args import served_model_names
from kdaserve.entrypoints.openai.http_guards import HostPolicy
from kdaserve.entrypoints.openai.metrics import ServerMetrics
from kdaserve.entrypoints.openai.reasoning_parser import get_reasoning_parser
from kdaserve.entrypoints.openai.serving_chat import OpenAIServingChat
from kdaserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kdaserve.entrypoints.openai.serving_engine import ModelInfo, RequestLimits
from kdaserve.entrypoints.openai.template_sandbox import RequestTemplateRenderer
from kdaserve.entrypoints.openai.tool_parser import get_tool_parser
from kdaserve.entrypoints.prompt_tokens import PromptTokenizer

logger = logging.getLogger("kdaserve.serve")


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its own shutdown, which would kill the process
    before the engine core is stopped; here the signal only starts the graceful shutdown."""

    @contextlib.contextmanager
    def capture_signals(self):
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def build_state(engine: AsyncEngine, args: argparse.Namespace, model: str,
                chat_template: str | None) -> ServerState:
    info = engine.info
    tokenizer = engine.tokenizer
    extra = args.additional_config
    vocab_size = int(info.get("vocab_size") or len(tokenizer))
    names = served_model_names(args, model)
    model_info = ModelInfo(names, model, int(info["max_model_len"]), vocab_size)
    shared = dict(limits=RequestLimits(extra["max_n_sequences"], extra["max_completion_prompts"]),
                  prompt_tokenizer=PromptTokenizer(tokenizer, model_info.max_model_len))
    request_templates = None
    if args.trust_request_chat_template:
        request_templates = RequestTemplateRenderer(
            info["tokenizer"], extra["request_chat_template_timeout"],
            model_info.max_model_len * shared["prompt_tokenizer"].max_token_chars)
        request_templates.start()
    chat = OpenAIServingChat(
        engine, tokenizer, model_info, chat_template=chat_template,
        reasoning_parser_cls=get_reasoning_parser(args.reasoning_parser)
        if args.reasoning_parser else None,
        tool_parser_cls=get_tool_parser(args.tool_call_parser) if args.tool_call_parser else None,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        mirror_reasoning_content=extra["mirror_reasoning_content"],
        request_templates=request_templates, **shared)
    completion = OpenAIServingCompletion(engine, tokenizer, model_info, **shared)
    metrics = ServerMetrics(names[0])
    engine.request_observer = metrics.observe
    return ServerState(engine, chat, completion, metrics, args.api_key,
                       extra["max_request_body_bytes"],
                       HostPolicy(args.host, extra["allowed_hosts"]))


async def serve(args: argparse.Namespace, model: str, engine_kwargs: dict[str, Any],
                chat_template: str | None) -> int:
    logger.info("starting the engine for %s", model)
    try:
        engine = await AsyncEngine.start(engine_kwargs,
                                         args.additional_config["engine_startup_timeout"],
                                         log_level="DEBUG" if args.uvicorn_log_level in (
                                             "debug", "trace") else "INFO")
    except EngineStartupError as e:
        raise ValueError(f"the engine failed to start: {e}") from e
    try:
        app = build_app(build_state(engine, args, model, chat_template))
        server = _Server(uvicorn.Config(app, host=args.host, port=args.port,
                                        log_level=args.uvicorn_log_level,
                                        access_log=not args.disable_uvicorn_access_log,
                                        timeout_keep_alive=5))
        logger.info("serving %s on http://%s:%d (max_model_len=%d)", model, args.host,
                    args.port, engine.info["max_model_len"])
        await server.serve()
    finally:
        await engine.shutdown()
    return 0
