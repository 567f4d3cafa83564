"""The grammar pieces against xgrammar itself: bitmask rows (plain and per draft position),
draft validation, terminated grammars, the mask on the logits rows, and the field-naming
checks of bad constraints."""

from __future__ import annotations

import time

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from kdaserve.core.sched_output import SchedulerOutput
from kdaserve.request import Request
from kdaserve.sample.grammar_mask import GrammarMask, apply_grammar_bitmask
from kdaserve.sampling_params import SamplingParams
from kdaserve.sampling_params import StructuredOutputsParams as SO
from kdaserve.structured_output.backend_xgrammar import bitmask_width
from kdaserve.structured_output.manager import StructuredOutputManager
from kdaserve.structured_output.spec import grammar_spec, validate_structured_outputs

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "size": {"enum": ["s", "m", "l"]}},
          "required": ["ok", "size"]}
STOP = [2970, 2972]


@pytest.fixture(scope="module")
def tok(tiny_preset):
    return AutoTokenizer.from_pretrained(tiny_preset)


def _compiled(backend, so: SO):
    return backend.compile(grammar_spec(so))


def _rows(backend, n: int) -> torch.Tensor:
    return torch.zeros((n, bitmask_width(backend.vocab_size)), dtype=torch.int32)


def _reference_row(backend, compiled, tokens: list[int]) -> torch.Tensor:
    """What xgrammar's own matcher allows after `tokens`."""
    m = xgr.GrammarMatcher(compiled, override_stop_tokens=STOP)
    for t in tokens:
        assert m.accept_token(t)
    row = xgr.allocate_token_bitmask(1, backend.vocab_size)
    m.fill_next_token_bitmask(row, 0)
    return row[0]


def _allowed(row: torch.Tensor, vocab_size: int) -> set[int]:
    bits = (row.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
    return set(torch.nonzero(bits.flatten()[:vocab_size]).flatten().tolist())


def test_rows_match_xgrammar_and_leave_the_matcher(backend, tok):
    compiled = _compiled(backend, SO(json=SCHEMA, disable_any_whitespace=True))
    grammar = backend.request_grammar(compiled, STOP)
    prefix = tok.encode('{"ok": true, "si', add_special_tokens=False)
    rows = _rows(backend, 1)
    grammar.fill_rows(rows, 0, [])
    assert torch.equal(rows[0], _reference_row(backend, compiled, []))
    assert grammar.accept_tokens(prefix)
    grammar.fill_rows(rows, 0, [])
    assert torch.equal(rows[0], _reference_row(backend, compiled, prefix))
    # After '"si' only the rest of "size" fits: a narrow mask.
    assert 0 < len(_allowed(rows[0], backend.vocab_size)) < 50


def test_spec_rows_follow_the_drafts(backend, tok):
    """Row j of a spec row is the mask after drafts[:j]; the matcher is rolled back after."""
    compiled = _compiled(backend, SO(json=SCHEMA, disable_any_whitespace=True))
    grammar = backend.request_grammar(compiled, STOP)
    drafts = tok.encode('{"ok": false', add_special_tokens=False)
    rows = _rows(backend, len(drafts) + 1)
    grammar.fill_rows(rows, 0, drafts)
    for j in range(len(drafts) + 1):
        assert torch.equal(rows[j], _reference_row(backend, compiled, drafts[:j])), j
    again = _rows(backend, 1)
    grammar.fill_rows(again, 0, [])
    assert torch.equal(again[0], rows[0])


def test_batch_fill_matches_one_by_one(backend, tok):
    """Many one-row requests are filled on xgrammar's threads: the same rows."""
    compiled = _compiled(backend, SO(json=SCHEMA, disable_any_whitespace=True))
    text = '{"ok": true, "size": "m"}'
    grammars, prefixes = [], []
    for cut in range(1, 21):
        prefix = tok.encode(text, add_special_tokens=False)[:cut % 9]
        g = backend.request_grammar(compiled, STOP)
        assert g.accept_tokens(prefix)
        grammars.append(g)
        prefixes.append(prefix)
    rows = _rows(backend, 2 * len(grammars))
    backend.fill_next_rows(grammars, list(range(0, 2 * len(grammars), 2)), rows)
    for i, prefix in enumerate(prefixes):
        assert torch.equal(rows[2 * i], _reference_row(backend, compiled, prefix)), i


def test_validate_truncates_an_invalid_draft(backend, tok):
    compiled = _compiled(backend, SO(regex=r"ab+c"))
    grammar = backend.request_grammar(compiled, STOP)
    a, b, x = (tok.convert_tokens_to_ids(c) for c in "abx")
    before = _rows(backend, 1)
    grammar.fill_rows(before, 0, [])
    assert grammar.validate_tokens([a, b, x, b]) == [a, b]
    assert grammar.validate_tokens([x, a]) == []
    after = _rows(backend, 1)
    grammar.fill_rows(after, 0, [])
    assert torch.equal(before, after)
    # A stop token completes the grammar: nothing after it is kept.
    c = tok.convert_tokens_to_ids("c")
    assert grammar.validate_tokens([a, b, c, STOP[0], a]) == [a, b, c, STOP[0]]


def test_terminated_grammar_allows_only_stop_tokens(backend, tok):
    compiled = _compiled(backend, SO(choice=["yes", "no"]))
    grammar = backend.request_grammar(compiled, STOP + [7])
    assert grammar.accept_tokens(tok.encode("yes", add_special_tokens=False))
    rows = _rows(backend, 2)
    grammar.fill_rows(rows, 0, [])
    assert _allowed(rows[0], backend.vocab_size) == {7, *STOP}   # complete: stop tokens only
    assert grammar.accept_tokens([STOP[1]]) and grammar.is_terminated()
    assert grammar.accept_tokens([STOP[0]])    # taken without effect (ignore_eos goes on)
    grammar.fill_rows(rows, 1, [])
    assert _allowed(rows[1], backend.vocab_size) == {7, *STOP}
    assert not backend.request_grammar(compiled, STOP).accept_tokens(
        tok.encode("maybe", add_special_tokens=False))


def test_choice_literals_are_escaped(backend, tok):
    choices = ['say "hi"', "back\\slash", "two\nlines", "naïve 😀"]
    compiled = _compiled(backend, SO(choice=choices))
    for c in choices:
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(c) and m.is_completed(), c
    m = xgr.GrammarMatcher(compiled)
    assert m.accept_string('say "hi') and not m.is_completed()   # a prefix, not a choice


def test_mask_hits_only_the_structured_logits_rows(backend):
    """Bitmask rows in the core's order land on their logits rows; other rows are untouched."""
    V = backend.vocab_size
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, bitmask_width(V)), generator=g,
                            dtype=torch.int64).to(torch.int32)
    logits = torch.randn(4, V, generator=g)
    want = logits.clone()
    for src, dst in ((0, 2), (1, 0)):
        allowed = torch.zeros(V, dtype=torch.bool)
        allowed[list(_allowed(bitmask[src], V))] = True
        want[dst] = want[dst].masked_fill(~allowed, float("-inf"))
    mask = GrammarMask.build(bitmask, [0, 1], [2, 0], 4, "cpu")
    apply_grammar_bitmask(logits, mask)
    assert torch.equal(logits, want)
    # Every row structured, in order: the bitmask is used as is, no row indices.
    full = GrammarMask.build(bitmask, [0, 1], [0, 1], 2, "cpu")
    assert full.rows is None and full.bitmask.data_ptr() == bitmask.data_ptr()


@pytest.mark.parametrize("so, field, words", [
    (SO(json='{"type": "object"'), "structured_outputs.json", "not valid JSON"),
    (SO(json={"type": "objectx"}), "structured_outputs.json", "JSON schema"),
    (SO(json="[1, 2]"), "structured_outputs.json", "is an object"),
    (SO(regex="([a-"), "structured_outputs.regex", "regular expression"),
    (SO(grammar="root ::= undefined_rule"), "structured_outputs.grammar", "grammar"),
    (SO(grammar="start: undefined_rule"), "structured_outputs.grammar", "grammar"),
])
def test_bad_constraints_name_the_field(so, field, words):
    with pytest.raises(ValueError, match=field) as info:
        validate_structured_outputs(so)
    assert words in str(info.value)


def test_constraint_shape_is_checked():
    for kwargs in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"choice": ["a", 1]},
                   {"regex": ""}, {"json": 3}):
        with pytest.raises(ValueError, match="structured_outputs"):
            SO(**kwargs)
    # From the wire (dataclasses.asdict of the params): a dict becomes the params again.
    sp = SamplingParams(structured_outputs={"regex": "a+", "json": None, "choice": None,
                                            "grammar": None, "json_object": None,
                                            "disable_any_whitespace": False})
    assert sp.structured_outputs == SO(regex="a+")
    assert validate_structured_outputs(SO(grammar='start: "x"')).kind == "lark"
    assert validate_structured_outputs(SO(grammar='root ::= "x"')).kind == "ebnf"


def _manager_with(backend, request: Request) -> StructuredOutputManager:
    manager = StructuredOutputManager(lambda: None, backend.vocab_size, backend=backend)
    manager.add_request(request, validate_structured_outputs(
        request.sampling_params.structured_outputs))
    deadline = time.monotonic() + 30
    while not manager.grammar_ready(request):
        assert time.monotonic() < deadline
        manager.wait_for_compile(0.1)
    return manager


def test_manager_fills_validates_and_accepts(backend, tok):
    """One request through the manager's hooks: its rows, its drafts cut at the first refused
    token, its sampled tokens accepted, and its grammar forgotten once it is gone."""
    req = Request("r", [1, 2, 3], SamplingParams(structured_outputs=SO(regex=r"ab+c")),
                  eos_token_ids=STOP)
    manager = _manager_with(backend, req)
    assert manager.active
    a, b, c, x = (tok.convert_tokens_to_ids(ch) for ch in "abcx")
    so = SchedulerOutput(num_scheduled_tokens={"r": 1, "other": 1},
                         sampling_req_ids={"r", "other"},
                         scheduled_spec_decode_tokens={"r": [a, b]})
    manager.grammar_bitmask(so, {"r": req, "other": Request("other", [1], SamplingParams())})
    assert so.structured_output_request_ids == ["r"]
    assert so.grammar_bitmask.shape == (3, bitmask_width(backend.vocab_size))
    first = _allowed(so.grammar_bitmask[0], backend.vocab_size)
    assert a in first and x not in first and b not in first    # "a", or a token like "ab"
    assert manager.validate_drafts({"r": [a, x, b], "other": [x]}) == {"r": [a], "other": [x]}
    from kdaserve.core.engine_output import EngineCoreOutput
    assert manager.accept_tokens([EngineCoreOutput("r", [a, b])]) == []
    assert manager.validate_drafts({"r": [b, c, STOP[0], b]}) == {"r": [b, c, STOP[0]]}
    assert manager.accept_tokens([EngineCoreOutput("r", [x])]) == ["r"]
    # Finished and gone from the scheduler: the next step forgets it.
    manager.grammar_bitmask(SchedulerOutput(finished_req_ids={"r"}), {})
    assert not manager.active
    manager.shutdown()


def test_failed_compilation_is_reported(backend):
    req = Request("bad", [1], SamplingParams(structured_outputs=SO(regex="a")))
    manager = StructuredOutputManager(lambda: None, backend.vocab_size, backend=backend)
    from kdaserve.structured_output.spec import GrammarSpec
    manager.add_request(req, GrammarSpec("ebnf", "root ::= nothing_here"))
    manager.wait_for_compile(30)
    assert not manager.grammar_ready(req)
    failed = manager.take_failed()
    assert [fid for fid, _ in failed] == ["bad"] and "nothing_here" in failed[0][1]
    manager.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_mask_matches_cpu_without_a_host_sync(dtype):
    V = 160_000
    g = torch.Generator().manual_seed(1)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, bitmask_width(V)), generator=g,
                            dtype=torch.int64).to(torch.int32)
    logits = (torch.randn(8, V, generator=g) * 3).to(dtype)
    want = logits.clone()
    apply_grammar_bitmask(want, GrammarMask.build(bitmask, [0, 1, 2], [5, 0, 3], 8, "cpu"))
    dev = logits.cuda()
    apply_grammar_bitmask(dev.clone(), GrammarMask.build(bitmask, [0, 1, 2], [5, 0, 3], 8,
                                                         "cuda"))   # compiles the kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = GrammarMask.build(bitmask, [0, 1, 2], [5, 0, 3], 8, "cuda")
        apply_grammar_bitmask(dev, mask)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(dev.cpu(), want)
