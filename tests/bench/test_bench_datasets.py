# SPDX-License-Identifier: Apache-2.0
import json

import pytest

from kdaserve.bench.datasets import PromptFactory, load_prompt_tokenizer


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return load_prompt_tokenizer(tokenizer_dir)


def test_candidates_exclude_special_tokens(tok):
    cand = set(tok.candidate_ids().tolist())
    assert tok.special_ids == {0, 1, 2}
    assert not cand & tok.special_ids
    assert len(cand) > 400


@pytest.mark.parametrize("length", [1, 2, 17, 256, 1000])
def test_text_prompts_have_exact_length(tok, length):
    prompts = PromptFactory(tok, length, seed=3).make(5, stream=1)
    for p in prompts:
        assert p.prompt_len == length
        assert len(tok.encode(p.prompt)) == length


def test_prompts_are_distinct_and_seeded(tok):
    f = PromptFactory(tok, 64, seed=42)
    a = [p.prompt for p in f.make(8, stream=1)]
    assert len(set(a)) == 8
    # No accidental prefix sharing: first tokens differ between prompts.
    firsts = {tuple(tok.encode(t)[:4]) for t in a}
    assert len(firsts) == 8
    assert a == [p.prompt for p in PromptFactory(tok, 64, seed=42).make(8, stream=1)]
    assert a != [p.prompt for p in f.make(8, stream=2)]
    assert a != [p.prompt for p in PromptFactory(tok, 64, seed=43).make(8, stream=1)]


def test_shared_prefix_text(tok):
    f = PromptFactory(tok, 200, seed=1, shared_prefix_len=150)
    prompts = f.make(4, stream=1)
    enc = [tok.encode(p.prompt) for p in prompts]
    assert all(len(e) == 200 for e in enc)
    # The first tokens of the prefix are shared exactly; only the boundary token may merge.
    assert len({tuple(e[:149]) for e in enc}) == 1
    assert len({tuple(e) for e in enc}) == 4


def test_token_id_prompts(tok):
    f = PromptFactory(tok, 300, seed=0, shared_prefix_len=100, token_ids=True)
    prompts = f.make(3, stream=5)
    assert all(len(p.prompt) == 300 == p.prompt_len for p in prompts)
    assert all(p.prompt[:100] == prompts[0].prompt[:100] for p in prompts)
    assert len({tuple(p.prompt[100:]) for p in prompts}) == 3
    assert not {i for p in prompts for i in p.prompt} & tok.special_ids


def test_config_only_folder_gives_token_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": 50, "bos_token_id": 0, "eos_token_id": [1, 2], "pad_token_id": 49}))
    tok = load_prompt_tokenizer(str(tmp_path))
    assert not tok.can_text
    assert tok.special_ids == {0, 1, 2, 49}
    p = PromptFactory(tok, 40, token_ids=True).make(2, stream=0)
    assert all(0 <= i < 50 and i not in (0, 1, 2, 49) for i in p[0].prompt)
    with pytest.raises(ValueError, match="cannot make text prompts"):
        PromptFactory(tok, 40)


def test_bad_arguments(tok, tmp_path):
    with pytest.raises(ValueError, match="input_len"):
        PromptFactory(tok, 0)
    with pytest.raises(ValueError, match="shared_prefix_len"):
        PromptFactory(tok, 10, shared_prefix_len=11)
    with pytest.raises(ValueError, match="no such path"):
        load_prompt_tokenizer(str(tmp_path / "missing"))
