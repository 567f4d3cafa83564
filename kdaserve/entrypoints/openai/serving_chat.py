# SPDX-License-Identifier: Apache-2.0
"""/v1/chat/completions: chat template -> engine -> message or SSE chunks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kdaserve.entrypoints.chat_utils import (UserTextGuard, added_token_texts, render_chat,
                                             template_kwargs)
from kdaserve.entrypoints.openai.chat_output import ChatOutputState
from kdaserve.entrypoints.openai.protocol import (ChatCompletionRequest, NamedToolChoice, now,
                                                  random_id, usage_dict)
from kdaserve.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIError, OpenAIServing,
                                                        prepend, sse, sse_error,
                                                        structured_outputs_of)
from kdaserve.entrypoints.openai.template_sandbox import (RequestTemplateRenderer,
                                                          TemplateRenderError)
from kdaserve.entrypoints.openai.tool_parser import NamedToolCallParser, RequiredToolCallParser
from kdaserve.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    """request_templates: the sandbox for request-supplied chat templates
    (--trust-request-chat-template); None refuses them."""

    def __init__(self, engine, tokenizer, model, *, chat_template: str | None = None,
                 reasoning_parser_cls=None, tool_parser_cls=None,
                 enable_auto_tool_choice: bool = False, mirror_reasoning_content: bool = True,
                 request_templates: RequestTemplateRenderer | None = None, **kwargs):
        super().__init__(engine, tokenizer, model, **kwargs)
        self.chat_template = chat_template
        self.reasoning_parser_cls = reasoning_parser_cls
        self.tool_parser_cls = tool_parser_cls
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.mirror_reasoning_content = mirror_reasoning_content
        self.request_templates = request_templates
        self._token_texts = added_token_texts(tokenizer)

    # ---------------------------------------------------------------------------- prompting

    async def build_prompt(self, messages: list[dict[str, Any]], *,
                           tools: list[dict] | None = None, documents: list[dict] | None = None,
                           add_generation_prompt: bool = True,
                           continue_final_message: bool = False,
                           chat_template: str | None = None,
                           kwargs: dict[str, Any] | None = None,
                           add_special_tokens: bool = False, truncate: int | None = None,
                           side: str | None = None) -> tuple[str, list[int]]:
        """(prompt text, token ids) of a conversation. The client's text tokenizes as text
        (chat_utils.UserTextGuard); a request's own chat_template needs the server's opt-in
        and renders in the sandbox; tokenization is bounded by the context length."""
        if chat_template is not None and self.request_templates is None:
            raise OpenAIError("a request's own chat_template is not accepted: the server was "
                              "not started with --trust-request-chat-template",
                              param="chat_template")
        try:
            kwargs = template_kwargs(kwargs)
        except ValueError as e:
            raise OpenAIError(str(e), param="chat_template_kwargs") from e
        guard = UserTextGuard(self._token_texts)
        messages = guard.protect(messages)
        call = dict(tools=guard.protect(tools), documents=guard.protect(documents),
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, kwargs=guard.protect(kwargs))
        if chat_template is not None:
            try:
                rendered = await self.request_templates.render(
                    messages, chat_template=chat_template, **call)
            except TemplateRenderError as e:
                raise OpenAIError(str(e), param="chat_template") from e
        else:
            rendered = await asyncio.to_thread(self._render, messages, call)
        pieces = guard.split(rendered)
        ids = await asyncio.to_thread(self.encode_prompt, pieces,
                                      add_special_tokens=add_special_tokens, param="messages",
                                      truncate=truncate, side=side)
        return "".join(pieces), ids

    def _render(self, messages: list[dict[str, Any]], call: dict[str, Any]) -> str:
        """The server's template (--chat-template, else the tokenizer's)."""
        if self.chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError("this model has no chat template; start the server with "
                              "--chat-template or use /v1/completions")
        try:
            return render_chat(self.tokenizer, messages, chat_template=self.chat_template,
                               **call)
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise OpenAIError(f"the chat template failed on these messages: {e}",
                              param="messages") from e

    def _tools_active(self, req: ChatCompletionRequest) -> bool:
        """The model's own tool-call format is parsed (tool_choice "auto")."""
        if not req.tools or req.tool_choice == "none" or req.forced_tool_choice:
            return False
        if not (self.enable_auto_tool_choice and self.tool_parser_cls is not None):
            raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and '
                              "--tool-call-parser to be set", param="tool_choice")
        return True

    def _tool_parser(self, req: ChatCompletionRequest, tools_active: bool):
        if isinstance(req.tool_choice, NamedToolChoice):
            return NamedToolCallParser(req.tool_choice.function.name)
        if req.tool_choice == "required":
            return RequiredToolCallParser()
        return self.tool_parser_cls() if tools_active else None

    # ---------------------------------------------------------------------------- the call

    async def create_chat_completion(self, req: ChatCompletionRequest):
        model_name = self.check_model(req.model)
        self.check_num_sequences(req.n)
        structured = await structured_outputs_of(req)
        tools_active = self._tools_active(req) and structured is None
        messages = [m.to_template_dict() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        prompt_text, prompt_ids = await self.build_prompt(
            messages, tools=tools, documents=req.documents,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, chat_template=req.chat_template,
            kwargs=kwargs, add_special_tokens=req.add_special_tokens,
            truncate=req.truncate_prompt_tokens, side=req.truncation_side)
        # A constrained output is all content (or tool-call JSON): no reasoning to split off.
        reasoning_cls = self.reasoning_parser_cls if structured is None else None
        parsing = reasoning_cls is not None or tools_active
        params = self.sampling_params(req, len(prompt_ids), req.requested_max_tokens,
                                      req.num_top_logprobs,
                                      skip_special_tokens=req.skip_special_tokens and not parsing)
        params.structured_outputs = structured
        engine_id = random_id("chatcmpl")
        request_id = engine_id if req.request_id is None else f"chatcmpl-{req.request_id}"
        gen = self.engine.generate(prompt_ids, params, engine_id, prompt=prompt_text,
                                   delta=req.stream, cache_salt=req.cache_salt,
                                   kv_transfer_params=self.kv_transfer_params(req))
        first = await self.first_output(gen)

        states = [ChatOutputState(reasoning_cls(prompt_text) if reasoning_cls else None,
                                  self._tool_parser(req, tools_active),
                                  self.mirror_reasoning_content)
                  for _ in range(params.n)]
        echo = None
        if req.echo and messages[-1]["role"] == "assistant":
            echo = messages[-1].get("content") or ""
        ctx = _ChatCall(request_id, model_name, now(), prompt_ids, req, states, echo)
        if req.stream:
            return self._stream(ctx, first, gen)
        return await self._full(ctx, first, gen)

    async def _full(self, ctx: "_ChatCall", out: RequestOutput,
                    gen: AsyncIterator[RequestOutput]) -> dict[str, Any]:
        async for out in gen:
            pass
        choices = []
        for comp in out.outputs:
            state = ctx.states[comp.index]
            state.text = comp.text
            message = ctx.shape(state.message())
            if ctx.echo is not None:
                message["content"] = ctx.echo + (message.get("content") or "")
            choice = {"index": comp.index, "message": message,
                      "logprobs": self.chat_logprobs(comp.token_ids, comp.logprobs,
                                                     ctx.req.top_logprobs or 0)
                      if ctx.req.logprobs else None,
                      "finish_reason": _finish_reason(comp.finish_reason,
                                                      "tool_calls" in message, ctx.req),
                      "stop_reason": comp.stop_reason}
            if ctx.req.return_token_ids:
                choice["token_ids"] = list(comp.token_ids)
            choices.append(choice)
        body = {"id": ctx.request_id, "object": "chat.completion", "created": ctx.created,
                "model": ctx.model_name, "choices": choices,
                "usage": usage_dict(len(ctx.prompt_ids),
                                    sum(len(c.token_ids) for c in out.outputs),
                                    out.num_cached_tokens)}
        if ctx.req.return_token_ids:
            body["prompt_token_ids"] = ctx.prompt_ids
        if ctx.req.kv_transfer_params is not None:
            body["kv_transfer_params"] = out.kv_transfer_params
        return body

    async def _stream(self, ctx: "_ChatCall", first: RequestOutput,
                      gen: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        num_tokens = [0] * len(ctx.states)
        role_sent = [False] * len(ctx.states)
        prompt_len = len(ctx.prompt_ids)
        try:
            async for out in prepend(first, gen):
                for comp in out.outputs:
                    i = comp.index
                    if not role_sent[i]:
                        role_sent[i] = True
                        chunk = ctx.chunk(i, {"role": "assistant", "content": ""}, None)
                        if ctx.req.return_token_ids and i == 0:
                            chunk["prompt_token_ids"] = ctx.prompt_ids
                        if ctx.req.continuous_usage:
                            chunk["usage"] = usage_dict(prompt_len, sum(num_tokens))
                        yield sse(chunk)
                        if ctx.echo:
                            yield sse(ctx.chunk(i, {"content": ctx.echo}, None))
                    num_tokens[i] += len(comp.token_ids)
                    final = comp.finish_reason is not None
                    delta = ctx.states[i].append(comp.text, final)
                    if delta is not None:
                        delta = ctx.shape(delta) or None
                    logprobs = (self.chat_logprobs(comp.token_ids, comp.logprobs,
                                                   ctx.req.top_logprobs or 0)
                                if ctx.req.logprobs and comp.token_ids else None)
                    if delta is None and ctx.states[i].plain and comp.token_ids:
                        # tokens without text yet (an incomplete UTF-8 character, a special
                        # token): streamed as an empty delta, as vLLM does and as
                        # /v1/completions does, so usage and ITL advance with every step
                        delta = {"content": ""}
                    if delta is None and not final and logprobs is None:
                        continue  # text held back by a parser: nothing to show yet
                    if delta is None:
                        delta = {"content": ""} if final else {}
                    reason = (_finish_reason(comp.finish_reason, ctx.states[i].has_tool_calls,
                                             ctx.req) if final else None)
                    chunk = ctx.chunk(i, delta, reason, logprobs)
                    if final:
                        chunk["choices"][0]["stop_reason"] = comp.stop_reason
                    if ctx.req.return_token_ids:
                        chunk["choices"][0]["token_ids"] = list(comp.token_ids)
                    if ctx.req.continuous_usage:
                        chunk["usage"] = usage_dict(prompt_len, sum(num_tokens))
                    yield sse(chunk)
            if ctx.req.include_usage:
                yield sse({"id": ctx.request_id, "object": "chat.completion.chunk",
                           "created": ctx.created, "model": ctx.model_name, "choices": [],
                           "usage": usage_dict(prompt_len, sum(num_tokens),
                                               out.num_cached_tokens)})
        except Exception as e:  # noqa: BLE001 - reported in-band, as vLLM does
            yield sse_error(e)
        finally:
            await gen.aclose()
        yield SSE_DONE


class _ChatCall:
    """The fixed facts of one chat call, shared by its chunks. echo: the text the reply starts
    with (vLLM's chat `echo`), or None."""

    def __init__(self, request_id, model_name, created, prompt_ids, req, states,
                 echo: str | None = None):
        self.request_id = request_id
        self.model_name = model_name
        self.created = created
        self.prompt_ids = prompt_ids
        self.req = req
        self.states = states
        self.echo = echo

    def shape(self, message: dict[str, Any]) -> dict[str, Any]:
        """A message or delta as the request asked: without reasoning (include_reasoning
        false), with at most one tool call (parallel_tool_calls false)."""
        if not self.req.include_reasoning:
            message.pop("reasoning", None)
            message.pop("reasoning_content", None)
        calls = message.get("tool_calls")
        if calls and self.req.parallel_tool_calls is False:
            calls = [c for c in calls if c.get("index", 0) == 0][:1]
            if calls:
                message["tool_calls"] = calls
            else:
                del message["tool_calls"]
        return message

    def chunk(self, index: int, delta: dict[str, Any], finish_reason: str | None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.request_id, "object": "chat.completion.chunk",
                "created": self.created, "model": self.model_name,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish_reason}]}


def _finish_reason(engine_reason: str | None, has_tool_calls: bool,
                   req: ChatCompletionRequest) -> str | None:
    """"tool_calls" when a stopped output called tools, except for a named tool_choice (OpenAI
    and vLLM answer "stop" there)."""
    if (engine_reason == "stop" and has_tool_calls
            and not isinstance(req.tool_choice, NamedToolChoice)):
        return "tool_calls"
    return engine_reason
