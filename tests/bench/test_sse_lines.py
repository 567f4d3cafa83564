"""The benchmark client's SSE line splitting: only CR, LF and CRLF end a line."""

from __future__ import annotations

import asyncio
import json

from kdaserve.bench.client import sse_lines


def _lines(chunks: list[str]) -> list[str]:
    async def gen():
        for c in chunks:
            yield c

    async def collect():
        return [line async for line in sse_lines(gen())]

    return asyncio.run(collect())


def test_separators_inside_json_stay_in_the_line():
    text = "a\u2028b\x85c\u2029d\x1ce\x0bf"
    event = "data: " + json.dumps({"choices": [{"text": text}]}, ensure_ascii=False)
    got = _lines([event + "\n\n", "data: [DONE]\n\n"])
    assert got == [event, "", "data: [DONE]", ""]
    assert json.loads(got[0][len("data: "):])["choices"][0]["text"] == text


def test_crlf_split_across_chunks_and_unterminated_tail():
    assert _lines(["data: 1\r", "\ndata: 2\r\n\r", "\ndata: 3"]) == \
        ["data: 1", "data: 2", "", "data: 3"]
    assert _lines(["x\ry\n", "z\r"]) == ["x", "y", "z"]
