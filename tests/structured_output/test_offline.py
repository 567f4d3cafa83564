"""Structured outputs end to end with the offline LLM on the tiny preset: outputs follow their
constraint on 100 random seeds in one batch, with and without speculative decoding (ngram, and
the draft model), under forking, chunked prefill and preemption; drafts are cut where the
grammar refuses them; unconstrained requests keep their tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kdaserve import SamplingParams
from kdaserve.sampling_params import StructuredOutputsParams as SO

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
SEEDS = range(100)

SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
          "required": ["ok", "size", "n", "tag"]}
REGEX = r"[a-z]{2,4}-\d{1,3}(\.[a-z]{2})?"


def _spec(name, tiny_preset):
    if name == "ngram":
        return {"speculative_config": NGRAM}
    if name == "draft_model":   # the target drafting for itself: drafts ignore the grammar
        return {"speculative_config": {"method": "draft_model", "model": tiny_preset,
                                       "num_speculative_tokens": 3}}
    return {}


def _generate(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_json_schema_holds_on_100_seeds(llms, tiny_preset, spec):
    llm = llms(**_spec(spec, tiny_preset))
    so = SO(json=SCHEMA, disable_any_whitespace=True)
    outs = _generate(llm, ["hello world"] * len(SEEDS),
                     [SamplingParams(max_tokens=96, seed=s, structured_outputs=so) for s in SEEDS])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 20   # sampled, not one answer


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_regex_holds_on_100_seeds(llms, tiny_preset, spec):
    llm = llms(**_spec(spec, tiny_preset))
    outs = _generate(llm, ["the quick brown fox"] * len(SEEDS),
                     [SamplingParams(max_tokens=32, seed=s, structured_outputs=SO(regex=REGEX))
                      for s in SEEDS])
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
    assert len({o.text for o in outs}) > 20


def test_choice_grammar_and_json_object(llms):
    llm = llms()
    tok = llm.get_tokenizer()
    choices = ["red", "green", 'say "blue"']
    grammar = 'root ::= "(" [0-9] ("+" [0-9])? ")"'
    # json_object: push the random model towards closing its strings and objects.
    close = {tok.convert_tokens_to_ids(c): 10.0 for c in ('"', "}")}
    params = ([SamplingParams(max_tokens=16, seed=s, structured_outputs=SO(choice=choices))
               for s in range(20)]
              + [SamplingParams(max_tokens=16, seed=s, structured_outputs=SO(grammar=grammar))
                 for s in range(20)]
              + [SamplingParams(max_tokens=96, seed=s, logit_bias=close,
                                structured_outputs=SO(json_object=True,
                                                      disable_any_whitespace=True))
                 for s in range(20)])
    outs = _generate(llm, ["hello"] * len(params), params)
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert {o.text for o in outs[:20]} <= set(choices) and len({o.text for o in outs[:20]}) > 1
    assert all(re.fullmatch(r"\([0-9](\+[0-9])?\)", o.text) for o in outs[20:40])
    assert all(isinstance(json.loads(o.text), dict) for o in outs[40:])


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_greedy_structured_output_is_lossless_under_spec(llms, tiny_preset, spec):
    """Greedy constrained outputs with speculation equal those without: the verification
    samples under the same masks, position by position."""
    prompts = ["ab-12 ab-12 ab-34 cd-56", "hello world", '{"ok": true, "size": "m"}']
    params = [SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=so)
              for so in (SO(regex=REGEX), SO(json=SCHEMA, disable_any_whitespace=True),
                         SO(choice=["cat", "dog", "catalog"]))]
    params = [p for p in params for _ in prompts]
    prompts = prompts * 3
    want = [o.token_ids for o in _generate(llms(), prompts, params)]
    llm = llms(**_spec(spec, tiny_preset))
    got = [o.token_ids for o in _generate(llm, prompts, params)]
    assert got == want
    stats = llm.llm_engine.spec_decoding_stats
    assert stats.num_draft_tokens > 0


def test_drafts_are_cut_where_the_grammar_refuses(llms, tiny_preset):
    """The proposer's drafts reach the scheduler cut before the first token the grammar
    refuses (the target drafting for itself proposes unconstrained tokens)."""
    llm = llms(**_spec("draft_model", tiny_preset))
    manager = llm.llm_engine.engine_core.structured_output
    seen = []
    validate = manager.validate_drafts

    def spy(drafts):
        out = validate(drafts)
        seen.extend((list(drafts.get(r, [])), list(out.get(r, []))) for r in drafts)
        return out

    manager.validate_drafts = spy
    try:
        outs = _generate(llm, ["hello world"] * 8,
                         [SamplingParams(max_tokens=32, seed=s, structured_outputs=SO(regex=REGEX))
                          for s in range(8)])
    finally:
        del manager.validate_drafts
    assert all(re.fullmatch(REGEX, o.text) for o in outs)
    assert seen and all(after == before[:len(after)] for before, after in seen)
    assert any(len(after) < len(before) for before, after in seen)


def test_unconstrained_requests_keep_their_tokens(llms, monkeypatch):
    """Greedy free-text requests give the same tokens alone and batched with constrained ones
    (the constrained ones only turn async scheduling off while they run); alone, no step
    builds or applies a mask."""
    import kdaserve.worker.model_runner as model_runner

    llm = llms()
    masked = []
    apply = model_runner.apply_grammar_bitmask
    monkeypatch.setattr(model_runner, "apply_grammar_bitmask",
                        lambda logits, mask: masked.append(1) or apply(logits, mask))
    prompts = ["hello world", "the lazy dog", "once upon a time"]
    plain = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in prompts]
    alone = [o.token_ids for o in _generate(llm, prompts, plain)]
    assert not masked and not llm.llm_engine.engine_core.structured_output.active
    mixed = _generate(llm, prompts + ["x"] * 4, plain + [
        SamplingParams(max_tokens=24, seed=s, structured_outputs=SO(regex=REGEX))
        for s in range(4)])
    assert [o.token_ids for o in mixed[:3]] == alone
    assert all(re.fullmatch(REGEX, o.text) for o in mixed[3:]) and masked


def test_a_grammar_that_fails_to_compile_aborts_its_request(llms, monkeypatch):
    """Every sample of the request ends as aborted (an n > 1 request forked from its prompt
    and one of one-token prompt queued as samples); the others run on."""
    llm = llms()
    manager = llm.llm_engine.engine_core.structured_output

    def fail(spec):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(manager, "_compile", fail)
    so = SO(regex="a+")
    outs = llm.generate(["hello world again", "hi", "hello"],
                        [SamplingParams(n=2, max_tokens=4, structured_outputs=so),
                         SamplingParams(n=2, max_tokens=4, structured_outputs=so),
                         SamplingParams(max_tokens=4, ignore_eos=True)], use_tqdm=False)
    for out in outs[:2]:
        assert [(c.finish_reason, c.token_ids) for c in out.outputs] == [("abort", [])] * 2
    assert outs[2].outputs[0].finish_reason == "length"


def test_samples_chunked_prefill_and_preemption(llms):
    """n > 1 samples of one request (each its own matcher), long prompts prefilled in chunks
    and a KV cache small enough to preempt: every output still follows its schema."""
    llm = llms(num_gpu_blocks=40, max_num_batched_tokens=96, long_prefill_token_threshold=48)
    so = SO(json=SCHEMA, disable_any_whitespace=True)
    prompts = [" ".join(["word"] * 90 + [str(i)]) for i in range(6)]
    params = [SamplingParams(n=3, max_tokens=96, seed=i, structured_outputs=so)
              for i in range(6)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        assert len(out.outputs) == 3
        for comp in out.outputs:
            assert comp.finish_reason == "stop", comp.text
            jsonschema.validate(json.loads(comp.text), SCHEMA)
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_bad_constraint_is_refused_and_the_engine_goes_on(llms):
    llm = llms()
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(["hi"], SamplingParams(structured_outputs=SO(regex="([a-")),
                     use_tqdm=False)
    out = _generate(llm, ["hi"], [SamplingParams(max_tokens=8, structured_outputs=SO(
        choice=["ok"]))])
    assert out[0].text == "ok"


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", [None, "ngram"])
def test_cuda_engine_masks_graph_steps(llms, tiny_preset, spec):
    """On CUDA (bf16, decode / verification graphs): constrained outputs hold, mixed with
    free-text requests in the same steps."""
    llm = llms(device="cuda", **_spec(spec, tiny_preset))
    assert str(llm.llm_engine.model_runner.device).startswith("cuda")
    params = ([SamplingParams(max_tokens=32, seed=s, structured_outputs=SO(regex=REGEX))
               for s in range(16)]
              + [SamplingParams(max_tokens=16, seed=s) for s in range(4)])
    outs = _generate(llm, ["the quick brown fox"] * len(params), params)
    assert all(o.finish_reason == "stop" and re.fullmatch(REGEX, o.text) for o in outs[:16])
    assert all(len(o.token_ids) > 0 for o in outs[16:])
