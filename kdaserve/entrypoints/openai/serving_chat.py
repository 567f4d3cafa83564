# SPDX-License-Identifier: Apache-2.0
"""/v1/chat/completions: chat template -> engine -> message or SSE chunks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kdaserve.entrypoints.openai.chat_output import ChatOutputState
from kdaserve.entrypoints.openai.protocol import (ChatCompletionRequest, NamedToolChoice, now,
                                                  random_id, usage_dict)
from kdaserve.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIError, OpenAIServing,
                                                        prepend, sse, sse_error,
                                                        structured_outputs_of)
from kdaserve.entrypoints.openai.tool_parser import NamedToolCallParser, RequiredToolCallParser
from kdaserve.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine, tokenizer, model, *, chat_template: str | None = None,
                 reasoning_parser_cls=None, tool_parser_cls=None,
                 enable_auto_tool_choice: bool = False, mirror_reasoning_content: bool = True):
        super().__init__(engine, tokenizer, model)
        self.chat_template = chat_template
        self.reasoning_parser_cls = reasoning_parser_cls
        self.tool_parser_cls = tool_parser_cls
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.mirror_reasoning_content = mirror_reasoning_content

    # ---------------------------------------------------------------------------- prompting

    def render_prompt(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                      add_generation_prompt: bool = True, continue_final_message: bool = False,
                      chat_template: str | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        template = chat_template or self.chat_template
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError("this model has no chat template; start the server with "
                              "--chat-template or use /v1/completions")
        kwargs = dict(template_kwargs or {})
        kwargs.update(tools=tools, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, tokenize=False)
        if template is not None:
            kwargs["chat_template"] = template
        try:
            text = self.tokenizer.apply_chat_template(messages, **kwargs)
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise OpenAIError(f"the chat template failed on these messages: {e}",
                              param="messages") from e
        return text, self.tokenizer.encode(text, add_special_tokens=False)

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
        structured = await structured_outputs_of(req)
        tools_active = self._tools_active(req) and structured is None
        messages = [m.to_template_dict() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        prompt_text, prompt_ids = await asyncio.to_thread(
            self.render_prompt, messages, tools, req.add_generation_prompt,
            req.continue_final_message, req.chat_template, req.chat_template_kwargs)
        # A constrained output is all content (or tool-call JSON): no reasoning to split off.
        reasoning_cls = self.reasoning_parser_cls if structured is None else None
        parsing = reasoning_cls is not None or tools_active
        params = self.sampling_params(req, len(prompt_ids), req.requested_max_tokens,
                                      req.num_top_logprobs,
                                      skip_special_tokens=req.skip_special_tokens and not parsing)
        params.structured_outputs = structured
        request_id = random_id("chatcmpl")
        gen = self.engine.generate(prompt_ids, params, request_id, prompt=prompt_text,
                                   delta=req.stream, cache_salt=req.cache_salt)
        first = await self.first_output(gen)

        states = [ChatOutputState(reasoning_cls(prompt_text) if reasoning_cls else None,
                                  self._tool_parser(req, tools_active),
                                  self.mirror_reasoning_content)
                  for _ in range(params.n)]
        ctx = _ChatCall(request_id, model_name, now(), prompt_ids, req, states)
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
            message = state.message()
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
                    num_tokens[i] += len(comp.token_ids)
                    final = comp.finish_reason is not None
                    delta = ctx.states[i].append(comp.text, final)
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
    """The fixed facts of one chat call, shared by its chunks."""

    def __init__(self, request_id, model_name, created, prompt_ids, req, states):
        self.request_id = request_id
        self.model_name = model_name
        self.created = created
        self.prompt_ids = prompt_ids
        self.req = req
        self.states = states

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
