import random

import numpy as np
import pytest

from kdaserve.spec_decode.ngram import NgramProposer, longest_suffix_match


def brute_force(tokens, k, min_n, max_n):
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= L:
            continue
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):            # most recent first
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_basic_prompt_lookup():
    p = NgramProposer(3, 1, 3)
    #          0  1  2  3  4  5  6  7  8
    toks = [5, 1, 2, 3, 9, 9, 1, 2]
    # suffix [1, 2] occurs at 1..2 -> followed by 3, 9, 9
    assert p.propose_one(toks) == [3, 9, 9]


def test_prefers_longest_then_most_recent():
    p = NgramProposer(2, 1, 3)
    # suffix [7, 8]: [x, 7, 8] matches only at the first occurrence with 3 tokens
    toks = [1, 7, 8, 4, 4, 2, 7, 8, 6, 6, 1, 7, 8]
    # n=3 suffix [1, 7, 8] occurs at 0..2 -> [4, 4]; the later [7, 8] at 6..7 is shorter
    assert p.propose_one(toks) == [4, 4]
    toks2 = [7, 8, 4, 4, 7, 8, 6, 6, 7, 8]
    # only n=2 matches; the most recent earlier occurrence is at 4..5 -> [6, 6]
    assert p.propose_one(toks2) == [6, 6]


def test_min_n_and_no_match():
    p = NgramProposer(4, 2, 4)
    assert p.propose_one([1, 2, 3, 4, 3]) == []           # only a 1-gram recurs
    assert p.propose_one([1]) == []
    assert p.propose_one([]) == []
    assert NgramProposer(4, 1, 4).propose_one([1, 2, 3, 4, 3]) == [4, 3]


def test_drafts_stop_at_sequence_end_and_respect_caps():
    p = NgramProposer(5, 1, 2)
    toks = [1, 2, 1, 2]
    # suffix [1, 2] ends at index 1 -> followers [1, 2] (only 2 left)
    assert p.propose_one(toks) == [1, 2]
    assert p.propose([toks, toks], max_drafts=[1, 0]) == [[1], []]
    # a repeated token: suffix [3, 3] most recent earlier occurrence ends at L - 2
    assert p.propose_one([3, 3, 3, 3]) == [3]


@pytest.mark.parametrize("seed", range(5))
def test_matches_brute_force(seed):
    rng = random.Random(seed)
    p = NgramProposer(4, 1, 3)
    p2 = NgramProposer(3, 2, 5)
    for _ in range(300):
        L = rng.randint(1, 40)
        toks = [rng.randint(0, 4) for _ in range(L)]
        assert p.propose_one(toks) == brute_force(toks, 4, 1, 3), toks
        assert p2.propose_one(toks) == brute_force(toks, 3, 2, 5), toks


def test_long_sequence_is_fast():
    import time
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 1000, 32768)
    p = NgramProposer(8, 1, 4)
    t0 = time.perf_counter()
    for _ in range(20):
        p.propose_one(toks)
    assert (time.perf_counter() - t0) / 20 < 0.01


def test_bad_config():
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        NgramProposer(4, 3, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, 0, 2)
    assert longest_suffix_match(np.array([1, 2, 3]), 1, 2) == (0, 0)
