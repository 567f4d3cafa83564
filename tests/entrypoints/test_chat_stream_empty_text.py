# SPDX-License-Identifier: Apache-2.0
"""Chat streaming of steps whose tokens render no text (a partial UTF-8 character, a skipped
special token): each still streams a chunk with empty content and its running usage, as vLLM
and /v1/completions do."""

import asyncio
import json

from kdaserve.entrypoints.openai.chat_output import ChatOutputState
from kdaserve.entrypoints.openai.protocol import ChatCompletionRequest
from kdaserve.entrypoints.openai.serving_chat import OpenAIServingChat, _ChatCall
from kdaserve.outputs import CompletionOutput, RequestOutput


def _outputs(texts: list[str]):
    for step, text in enumerate(texts):
        final = step == len(texts) - 1
        yield RequestOutput("r", None, [1, 2, 3], [CompletionOutput(
            0, text, [100 + step], finish_reason="length" if final else None)], final)


async def _collect(texts: list[str]) -> list[dict]:
    req = ChatCompletionRequest(**{
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    ctx = _ChatCall("chatcmpl-1", "m", 0, [1, 2, 3], req, [ChatOutputState(None, None, False)])
    outs = _outputs(texts)

    async def gen():
        for o in outs:
            yield o

    g = gen()
    first = await anext(g)
    serving = object.__new__(OpenAIServingChat)   # _stream needs no engine
    events = [e async for e in serving._stream(ctx, first, g)]
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def test_every_step_streams_a_chunk_even_without_text():
    chunks = asyncio.run(_collect(["", "a", "", "", "b"]))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    steps = [c for c in chunks[1:] if c["choices"]]
    assert [c["choices"][0]["delta"]["content"] for c in steps] == ["", "a", "", "", "b"]
    assert [c["usage"]["completion_tokens"] for c in steps] == [1, 2, 3, 4, 5]
    assert steps[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
