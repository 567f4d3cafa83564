# SPDX-License-Identifier: Apache-2.0
"""What chat and completion serving share: the model check, the per-request limits, bounded
prompt tokenization, request -> SamplingParams, logprob formatting, SSE framing, and the error
type that becomes an OpenAI error body."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kdaserve.disagg.params import RemotePrefill
from kdaserve.engine.async_engine import AsyncEngine, EngineDeadError
from kdaserve.entrypoints.openai.protocol import SamplingFields, StructuredOutputError
from kdaserve.entrypoints.prompt_tokens import PromptTokenizer, PromptTooLongError
from kdaserve.outputs import Logprob, RequestOutput
from kdaserve.sampling_params import SamplingParams, StructuredOutputsParams

_STATUS_TYPES = {401: "authentication_error", 404: "not_found_error", 500: "internal_error",
                 503: "service_unavailable"}
"""OpenAI error type by HTTP status; any other status is an invalid_request_error."""


class OpenAIError(Exception):
    """Raised anywhere in a handler; the app turns it into `{"error": {...}}` with `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        err_type = _STATUS_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": err_type, "param": self.param,
                          "code": self.code}}


@dataclass
class ModelInfo:
    served_names: list[str]
    root: str
    """The local model path: accepted as a model name in requests, never shown to clients."""
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on the work one request may start (--additional-config keys of the same names)."""

    max_n_sequences: int = 256
    """Sequences one request may generate: n, times the number of prompts on /v1/completions."""
    max_completion_prompts: int = 256
    """Prompts in one /v1/completions request."""


def context_length_error(limit: int, num_tokens: int, param: str,
                         at_least: bool = False) -> "OpenAIError":
    more = "more than " if at_least else ""
    return OpenAIError(
        f"This model's maximum context length is {limit} tokens. However, your request has "
        f"{more}{num_tokens} input tokens. Please reduce the length of the input.",
        param=param, code="context_length_exceeded")


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: BaseException) -> str:
    if isinstance(exc, OpenAIError):
        return sse(exc.body())
    status = 503 if isinstance(exc, EngineDeadError) else 500
    return sse(OpenAIError(str(exc) or type(exc).__name__, status).body())


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer, model: ModelInfo, *,
                 limits: RequestLimits | None = None,
                 prompt_tokenizer: PromptTokenizer | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model
        self.limits = limits or RequestLimits()
        self.prompt_tokenizer = prompt_tokenizer or PromptTokenizer(tokenizer,
                                                                    model.max_model_len)
        self._token_strs: dict[int, str] = {}

    def check_num_sequences(self, n: int, num_prompts: int = 1) -> None:
        """n samples of num_prompts prompts: at most max_n_sequences sequences."""
        limit = self.limits.max_n_sequences
        if n * num_prompts > limit:
            what = f"n={n}" if num_prompts == 1 else f"n={n} x {num_prompts} prompts"
            raise OpenAIError(f"{what} asks for {n * num_prompts} sequences; this server "
                              f"allows at most {limit} per request", param="n")

    def encode_prompt(self, pieces: list[str], *, add_special_tokens: bool, param: str,
                      truncate: int | None = None, side: str | None = None) -> list[int]:
        """Token ids of prompt text (PromptTokenizer: bounded work, vLLM's
        truncate_prompt_tokens / truncation_side); a prompt that cannot fit is the
        context-length error naming `param`."""
        try:
            return self.prompt_tokenizer.encode(pieces, add_special_tokens=add_special_tokens,
                                                truncate=truncate, side=side or "left")
        except PromptTooLongError as e:
            raise context_length_error(e.limit, e.num_tokens, param, not e.exact) from e
        except ValueError as e:
            raise OpenAIError(str(e), param="truncate_prompt_tokens") from e

    def check_model(self, name: str | None) -> str:
        """The served name to echo back; unknown names are a 404."""
        if name is None or name == "":
            return self.model.served_names[0]
        if name not in self.model.served_names and name != self.model.root:
            raise OpenAIError(f"The model `{name}` does not exist.", 404, "model",
                              "model_not_found")
        return name

    def check_token_ids(self, token_ids: list[int], what: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise OpenAIError(f"{what}: token id {bad[0]} is outside the vocabulary "
                              f"[0, {self.model.vocab_size})", param=what)

    def sampling_params(self, req: SamplingFields, prompt_len: int, max_tokens: int | None,
                        logprobs: int | None, skip_special_tokens: bool,
                        prompt_param: str = "messages") -> SamplingParams:
        """prompt_param: the request field that holds the prompt (named by the context-length
        error)."""
        limit = self.model.max_model_len
        if prompt_len == 0:
            raise OpenAIError("the prompt is empty (no tokens)", param=prompt_param)
        if prompt_len >= limit:
            raise context_length_error(limit, prompt_len, prompt_param)
        room = limit - prompt_len
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the input, {max_tokens} in "
                f"the completion). Please reduce the length of the input or the completion.",
                param="max_tokens", code="context_length_exceeded")
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        logit_bias = {int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None
        if logit_bias:
            self.check_token_ids(list(logit_bias), "logit_bias")
        try:
            return SamplingParams(
                n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                # a top_k that covers the vocabulary is no top-k (the sampler's int32 rows
                # could not hold any larger value)
                top_k=-1 if req.top_k is None or req.top_k >= self.model.vocab_size
                else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=(1.0 if req.repetition_penalty is None
                                    else req.repetition_penalty),
                logit_bias=logit_bias,
                max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
                stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs,
                skip_special_tokens=skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output)
        except ValueError as e:
            raise OpenAIError(str(e)) from e

    # ------------------------------------------------------------------------------ logprobs

    def token_str(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_strs[token_id] = s
        return s

    @staticmethod
    def ranked(step: dict[int, Logprob]) -> list[tuple[int, Logprob, int]]:
        """(token_id, logprob, rank) by descending probability; ranks computed if missing."""
        items = sorted(step.items(), key=lambda kv: -kv[1].logprob)
        return [(tid, lp, lp.rank if lp.rank is not None else r + 1)
                for r, (tid, lp) in enumerate(items)]

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
                      top_k: int) -> dict[str, Any]:
        content = []
        for tid, step in zip(token_ids, logprobs or []):
            chosen = step.get(tid)
            s = self.token_str(tid, chosen)
            top = [{"token": (ts := self.token_str(t, lp)), "logprob": max(lp.logprob, -9999.0),
                    "bytes": list(ts.encode("utf-8", errors="replace"))}
                   for t, lp, rank in self.ranked(step) if rank <= top_k][:top_k]
            content.append({"token": s,
                            "logprob": -9999.0 if chosen is None else max(chosen.logprob, -9999.0),
                            "bytes": list(s.encode("utf-8", errors="replace")),
                            "top_logprobs": top})
        return {"content": content}

    def completion_logprobs(self, token_ids: list[int],
                            logprobs: list[dict[int, Logprob]] | None, top_k: int,
                            text_offset: int) -> dict[str, Any]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for tid, step in zip(token_ids, logprobs or []):
            chosen = step.get(tid)
            s = self.token_str(tid, chosen)
            out["tokens"].append(s)
            out["token_logprobs"].append(None if chosen is None else max(chosen.logprob, -9999.0))
            out["top_logprobs"].append(
                {self.token_str(t, lp): max(lp.logprob, -9999.0)
                 for t, lp, rank in self.ranked(step) if rank <= top_k} if top_k else None)
            out["text_offset"].append(text_offset)
            text_offset += len(s)
        return out

    def kv_transfer_params(self, req: SamplingFields, num_prompts: int = 1) -> dict | None:
        """The request's kv_transfer_params, checked against this server's KV role (a 400
        naming the field when it cannot be honoured)."""
        params = req.kv_transfer_params
        if params is None:
            return None
        role = self.engine.info.get("kv_role")

        def refuse(why: str) -> OpenAIError:
            return OpenAIError(f"kv_transfer_params: {why}", param="kv_transfer_params")

        if role is None:
            raise refuse("this server was started without --kv-transfer-config")
        if num_prompts != 1:
            raise refuse("only one prompt per request can be transferred")
        if params.get("do_remote_prefill"):
            if role == "kv_producer":
                raise refuse("a kv_producer instance does not pull remote prefills")
            try:
                RemotePrefill.from_params(params)
            except ValueError as e:
                raise refuse(str(e).removeprefix("kv_transfer_params ")) from e
        elif params.get("do_remote_decode"):
            if role == "kv_consumer":
                raise refuse("a kv_consumer instance does not hold prefills for others")
        else:
            raise refuse("set do_remote_decode (prefill) or do_remote_prefill (decode)")
        return params

    # ---------------------------------------------------------------------------- generation

    async def first_output(self, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
        """Wait for a request's first output; engine rejections become HTTP errors here, before
        any response bytes are sent."""
        try:
            return await anext(gen)
        except ValueError as e:
            raise OpenAIError(str(e)) from e
        except EngineDeadError as e:
            raise OpenAIError(str(e), 503) from e


async def structured_outputs_of(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, checked off the event loop (parsing a schema takes a
    while, the first one also the grammar library's import); a bad one is a 400 naming its
    field. Requests without one cost nothing here."""
    if not req.wants_structured_output:
        return None
    try:
        return await asyncio.to_thread(req.structured_outputs_params)
    except StructuredOutputError as e:
        raise OpenAIError(str(e), param=e.param) from None


async def prepend(first: RequestOutput, gen: AsyncIterator[RequestOutput]):
    """`first` (an output already taken from `gen`), then the rest of `gen`; closes `gen`."""
    try:
        yield first
        async for out in gen:
            yield out
    finally:
        await gen.aclose()


async def merge_async_iterators(*iterators: AsyncIterator) -> AsyncIterator[tuple[int, Any]]:
    """Yield (i, item) from several async iterators as items arrive; close all on exit."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await it.aclose()
