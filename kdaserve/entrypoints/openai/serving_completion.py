# SPDX-License-Identifier: Apache-2.0
"""/v1/completions: one engine request per prompt (text or token ids), n samples each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kdaserve.entrypoints.openai.protocol import CompletionRequest, now, random_id, usage_dict
from kdaserve.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIError, OpenAIServing,
                                                        merge_async_iterators, prepend, sse,
                                                        sse_error, structured_outputs_of)
from kdaserve.outputs import RequestOutput


def split_prompts(prompt: str | list) -> list[str | list[int]]:
    """The four accepted shapes -> a list of prompts, each a string or a token-id list."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


class OpenAIServingCompletion(OpenAIServing):
    def _tokenize(self, prompts: list[str | list[int]],
                  req: CompletionRequest) -> list[tuple[str, list[int]]]:
        """(text, token ids) per prompt; text prompts tokenized with bounded work, token-id
        prompts truncated like text ones."""
        result = []
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise OpenAIError("prompt must not be empty", param="prompt")
                ids = self.encode_prompt([p], add_special_tokens=req.add_special_tokens,
                                         param="prompt", truncate=req.truncate_prompt_tokens,
                                         side=req.truncation_side)
                result.append((p, ids))
            else:
                self.check_token_ids(p, "prompt")
                if req.truncate_prompt_tokens is not None:
                    p = self._truncate_ids(p, req.truncate_prompt_tokens, req.truncation_side)
                result.append((self.tokenizer.decode(p, skip_special_tokens=False), p))
        return result

    def _truncate_ids(self, ids: list[int], truncate: int, side: str | None) -> list[int]:
        keep = self.model.max_model_len if truncate == -1 else truncate
        if keep > self.model.max_model_len:
            raise OpenAIError(f"truncate_prompt_tokens={truncate} is greater than max_model_len"
                              f"={self.model.max_model_len}; request a smaller truncation size",
                              param="truncate_prompt_tokens")
        return ids[:keep] if side == "right" else ids[-keep:]

    async def create_completion(self, req: CompletionRequest):
        model_name = self.check_model(req.model)
        prompt_list = split_prompts(req.prompt)
        limit = self.limits.max_completion_prompts
        if len(prompt_list) > limit:
            raise OpenAIError(f"the request has {len(prompt_list)} prompts; this server allows "
                              f"at most {limit} per request", param="prompt")
        self.check_num_sequences(req.n, len(prompt_list))
        structured = await structured_outputs_of(req)
        kv_params = self.kv_transfer_params(req, len(prompt_list))
        prompts = await asyncio.to_thread(self._tokenize, prompt_list, req)
        base_id = random_id("cmpl")
        params = [self.sampling_params(req, len(ids), req.requested_max_tokens, req.logprobs,
                                       req.skip_special_tokens, prompt_param="prompt")
                  for _, ids in prompts]
        for p in params:
            p.structured_outputs = structured
        gens = [self.engine.generate(ids, p, f"{base_id}-{i}", prompt=text, delta=req.stream,
                                     cache_salt=req.cache_salt, kv_transfer_params=kv_params)
                for i, ((text, ids), p) in enumerate(zip(prompts, params))]
        try:
            firsts = await asyncio.gather(*(self.first_output(g) for g in gens))
        except BaseException:
            for g in gens:
                await g.aclose()
            raise
        gens = [prepend(f, g) for f, g in zip(firsts, gens)]
        response_id = base_id if req.request_id is None else f"cmpl-{req.request_id}"
        ctx = _CompletionCall(response_id, model_name, now(), prompts, req)
        if req.stream:
            return self._stream(ctx, gens)
        return await self._full(ctx, gens)

    async def _full(self, ctx: "_CompletionCall", gens) -> dict[str, Any]:
        finals: list[RequestOutput | None] = [None] * len(gens)
        async for i, out in merge_async_iterators(*gens):
            finals[i] = out
        n = ctx.req.n
        choices, num_generated, num_cached = [], 0, 0
        for p, (out, (prompt_text, prompt_ids)) in enumerate(zip(finals, ctx.prompts)):
            num_cached += out.num_cached_tokens
            for comp in out.outputs:
                num_generated += len(comp.token_ids)
                text = prompt_text + comp.text if ctx.req.echo else comp.text
                choice = {"index": p * n + comp.index, "text": text,
                          "logprobs": self.completion_logprobs(
                              comp.token_ids, comp.logprobs, ctx.req.logprobs, 0)
                          if ctx.req.logprobs is not None else None,
                          "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}
                if ctx.req.return_token_ids:
                    choice["prompt_token_ids"] = prompt_ids
                    choice["token_ids"] = list(comp.token_ids)
                choices.append(choice)
        body = {"id": ctx.request_id, "object": "text_completion", "created": ctx.created,
                "model": ctx.model_name, "choices": choices,
                "usage": usage_dict(ctx.num_prompt_tokens, num_generated, num_cached)}
        if ctx.req.kv_transfer_params is not None:
            body["kv_transfer_params"] = finals[0].kv_transfer_params
        return body

    async def _stream(self, ctx: "_CompletionCall", gens) -> AsyncIterator[str]:
        n = ctx.req.n
        num_tokens = [0] * (len(gens) * n)
        text_len = [0] * (len(gens) * n)
        started = [False] * (len(gens) * n)
        num_cached = [0] * len(gens)
        merged = merge_async_iterators(*gens)
        try:
            async for p, out in merged:
                num_cached[p] = out.num_cached_tokens
                for comp in out.outputs:
                    i = p * n + comp.index
                    text = comp.text
                    if ctx.req.echo and not started[i]:
                        text = ctx.prompts[p][0] + text
                    started[i] = True
                    final = comp.finish_reason is not None
                    if not text and not comp.token_ids and not final:
                        continue
                    num_tokens[i] += len(comp.token_ids)
                    choice = {"index": i, "text": text,
                              "logprobs": self.completion_logprobs(
                                  comp.token_ids, comp.logprobs, ctx.req.logprobs, text_len[i])
                              if ctx.req.logprobs is not None else None,
                              "finish_reason": comp.finish_reason}
                    text_len[i] += len(text)
                    if final:
                        choice["stop_reason"] = comp.stop_reason
                    if ctx.req.return_token_ids:
                        choice["token_ids"] = list(comp.token_ids)
                    chunk = {"id": ctx.request_id, "object": "text_completion",
                             "created": ctx.created, "model": ctx.model_name,
                             "choices": [choice]}
                    if ctx.req.continuous_usage:
                        chunk["usage"] = usage_dict(ctx.num_prompt_tokens, sum(num_tokens))
                    yield sse(chunk)
            if ctx.req.include_usage:
                yield sse({"id": ctx.request_id, "object": "text_completion",
                           "created": ctx.created, "model": ctx.model_name, "choices": [],
                           "usage": usage_dict(ctx.num_prompt_tokens, sum(num_tokens),
                                               sum(num_cached))})
        except Exception as e:  # noqa: BLE001 - reported in-band
            yield sse_error(e)
        finally:
            await merged.aclose()
        yield SSE_DONE


class _CompletionCall:
    def __init__(self, request_id, model_name, created, prompts, req: CompletionRequest):
        self.request_id = request_id
        self.model_name = model_name
        self.created = created
        self.prompts = prompts
        self.req = req
        self.num_prompt_tokens = sum(len(ids) for _, ids in prompts)
