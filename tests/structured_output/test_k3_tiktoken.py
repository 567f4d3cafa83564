"""Structured outputs on a Kimi tiktoken folder (kimi-k3-tiny: tiktoken.model, no
tokenizer.json): the grammar compiles against kdaserve's own tokenizer, JSON-schema and regex
outputs hold on many seeds, and no added (control) token is ever emitted as text."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kdaserve import SamplingParams
from kdaserve.sampling_params import StructuredOutputsParams as SO
from tests.models.k3_tiny import k3_tiny_dir, make_k3_llm, one_torch_thread  # noqa: F401

pytest.importorskip("xgrammar")

SEEDS = range(24)
SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                          "maximum": 99}},
          "required": ["ok", "n"]}
REGEX = r"[a-z]{2,4}-\d{1,3}"


def test_tokenizer_info_marks_added_tokens_special(k3_tiny_dir):
    from kdaserve.models.tokenizer import get_tokenizer
    from kdaserve.structured_output.backend_xgrammar import tokenizer_info

    tok = get_tokenizer(k3_tiny_dir)
    info = tokenizer_info(tok, len(tok))
    assert set(info.special_token_ids) >= set(tok.special_tokens.values()) - {tok.eos_token_id}
    assert info.stop_token_ids == [tok.eos_token_id]


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_constrained_outputs_hold_on_a_tiktoken_folder(make_k3_llm, k3_tiny_dir, kind):
    from kdaserve.models.tokenizer import get_tokenizer

    special = set(get_tokenizer(k3_tiny_dir).special_tokens.values())
    llm = make_k3_llm()
    so = SO(json=SCHEMA, disable_any_whitespace=True) if kind == "json" else SO(regex=REGEX)
    outs = llm.generate(["hello world"] * len(SEEDS),
                        [SamplingParams(max_tokens=48, seed=s, structured_outputs=so)
                         for s in SEEDS], use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    for out, text in zip(outs, texts):
        assert out.outputs[0].finish_reason == "stop", text
        assert not set(out.outputs[0].token_ids[:-1]) & special, out.outputs[0].token_ids
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, text), text
    assert len(set(texts)) > 4   # sampled, not one answer
