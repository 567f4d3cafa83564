import math

import pytest
import torch

from kdaserve.sample.metadata import SamplingMetadata, min_tokens_banned_ids
from kdaserve.sample.sampler import (
    Sampler,
    apply_min_p,
    apply_top_k_top_p,
    filter_logits,
    to_logprob_dicts,
)
from kdaserve.sampling_params import SamplingParams as SP

VOCAB = 64

# Upper 0.1% points of chi-square; a correct sampler fails one of these tests 1 time in 1000 seeds.
CHI2_999 = {3: 16.27, 4: 18.47, 7: 24.32, 9: 27.88}


def _logits(batch: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * 3.0


def _sample(logits, params, generators=None, banned=None):
    md = SamplingMetadata.build(params, generators, banned)
    return Sampler()(logits, md)


def test_greedy_equals_argmax():
    logits = _logits(16)
    out = _sample(logits, [SP(temperature=0.0)] * 16)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_mixed_batch_greedy_rows_stay_argmax():
    logits = _logits(8)
    params = [SP(temperature=0.0) if i % 2 == 0 else SP(temperature=1.5, top_p=0.9)
              for i in range(8)]
    torch.manual_seed(0)
    out = _sample(logits, params)
    assert torch.equal(out.sampled_token_ids[0::2], logits.argmax(-1)[0::2])


def test_bf16_logits():
    logits = _logits(4).to(torch.bfloat16)
    out = _sample(logits, [SP(temperature=0.0), SP(temperature=1.0, top_k=1)] * 2)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))


@pytest.mark.parametrize("params", [
    SP(temperature=1.0, top_k=1),
    SP(temperature=2.0, top_k=1, top_p=0.5),
    SP(temperature=1.0, top_p=1e-6),
    SP(temperature=1.0, top_p=1e-9),  # 1 - p rounds to 1.0 in fp32: the argmax must survive
    SP(temperature=3.0, min_p=1.0),
])
def test_degenerate_filters_equal_greedy(params):
    logits = _logits(32, vocab=1000, seed=1)
    torch.manual_seed(1)
    out = _sample(logits, [params] * 32)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_top_k_only_path_matches_sorted_path():
    logits = _logits(6, seed=2)
    top_k = torch.tensor([1, 5, 0, 64, 100, 3], dtype=torch.int32)
    fast = apply_top_k_top_p(logits, top_k, None, max_top_k=100)
    slow = apply_top_k_top_p(logits, top_k, torch.ones(6))
    assert torch.equal(torch.isinf(fast), torch.isinf(slow))
    kept = (~torch.isinf(fast)).sum(-1).tolist()
    assert kept == [1, 5, VOCAB, VOCAB, VOCAB, 3]


@pytest.mark.parametrize("min_p", [None, 0.2])
def test_top_k_threshold_keeps_what_the_mask_keeps(min_p):
    """Top-k alone with want_tau (the race's input): the logits stay unmasked and l >= tau keeps
    exactly the tokens the masking path keeps, ties and rows with top-k off included."""
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    logits[1, :20] = 9.0   # ties across the k-th logit
    top_k = torch.tensor([1, 10, 0, 299, 300])
    mp = None if min_p is None else torch.full((5,), min_p)
    masked, tau = filter_logits(logits, top_k, None, mp, max_top_k=300)
    assert tau is None
    kept, tau = filter_logits(logits, top_k, None, mp, max_top_k=300, want_tau=True)
    assert tau.shape == (5,)
    if min_p is None:
        assert torch.equal(kept, logits)
    assert torch.equal(torch.isfinite(masked), torch.isfinite(kept) & (kept >= tau[:, None]))
    if min_p is None:
        assert torch.isfinite(masked).sum(1).tolist() == [1, 20, 300, 299, 300]


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # Cumulative mass 0.5, 0.8, 0.95, 1.0; thresholds kept off those float-sensitive edges.
    for p, want in [(0.4, 1), (0.49, 1), (0.6, 2), (0.79, 2), (0.81, 3), (0.96, 4), (1.0, 4)]:
        masked = apply_top_k_top_p(logits, None, torch.tensor([p]))
        assert (~torch.isinf(masked)).sum().item() == want, p


def test_min_p_mask():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    masked = apply_min_p(torch.log(probs), torch.tensor([0.55]))  # threshold 0.22
    assert torch.isinf(masked).tolist() == [[False, False, True, True]]
    off = apply_min_p(torch.log(probs), torch.tensor([0.0]))
    assert not torch.isinf(off).any()


def test_min_p_sampling_stays_above_threshold():
    logits = _logits(1, seed=3).expand(4000, VOCAB).contiguous()
    probs = torch.softmax(logits[0], -1)
    allowed = probs >= 0.1 * probs.max()
    torch.manual_seed(3)
    out = _sample(logits, [SP(temperature=1.0, min_p=0.1)] * 4000).sampled_token_ids
    assert allowed[out].all()
    # Every allowed token shows up: the filter does not collapse to greedy.
    assert set(out.tolist()) == set(allowed.nonzero().flatten().tolist())


def _chi_square(samples: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    support = expected_probs > 0
    counts = torch.bincount(samples, minlength=expected_probs.numel()).double()
    assert counts[~support].sum() == 0, "sampled a token with probability 0"
    n = samples.numel()
    exp = expected_probs[support].double() * n
    stat = ((counts[support] - exp) ** 2 / exp).sum().item()
    return stat, int(support.sum().item()) - 1


def test_temperature_sampling_matches_softmax():
    vocab, n, temp = 10, 50_000, 0.7
    logits = torch.tensor([[1.0, 0.5, 0.2, 0.0, -0.3, -0.5, -1.0, -1.2, -2.0, 0.8]])
    torch.manual_seed(1234)
    out = _sample(logits.expand(n, vocab).contiguous(), [SP(temperature=temp)] * n)
    stat, dof = _chi_square(out.sampled_token_ids, torch.softmax(logits[0] / temp, -1))
    assert stat < CHI2_999[dof], stat


def test_top_k_top_p_sampling_matches_truncated_softmax():
    probs = torch.tensor([0.3, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.02])
    n = 40_000
    logits = torch.log(probs).unsqueeze(0).expand(n, -1).contiguous()
    torch.manual_seed(99)
    # top-k 6 -> renormalised [.3,.25,.15,.12,.08,.05]/.95; top-p 0.8 keeps the first 4
    # (cumulative .316, .579, .737, .863).
    out = _sample(logits, [SP(temperature=1.0, top_k=6, top_p=0.8)] * n)
    want = torch.zeros(8)
    want[:4] = probs[:4] / probs[:4].sum()
    stat, dof = _chi_square(out.sampled_token_ids, want)
    assert stat < CHI2_999[dof], stat


def _run_seeded(logits_steps, params, seeded_rows):
    gens = {row: torch.Generator().manual_seed(seed) for row, seed in seeded_rows.items()}
    sampler = Sampler()
    md = SamplingMetadata.build(params, gens)
    return torch.stack([sampler(lg, md).sampled_token_ids for lg in logits_steps])  # [T, B]


def test_seeded_row_is_batch_invariant():
    steps = 20
    target = [_logits(1, seed=100 + t) for t in range(steps)]
    alone = _run_seeded(target, [SP(temperature=1.0, seed=7)], {0: 7})[:, 0]

    # Same request at row 2 of a batch with unseeded rows and another seeded row.
    batched_logits = [torch.cat([_logits(2, seed=200 + t), target[t], _logits(1, seed=300 + t)])
                      for t in range(steps)]
    params = [SP(temperature=0.9), SP(temperature=1.0, top_p=0.9),
              SP(temperature=1.0, seed=7), SP(temperature=1.2, seed=8)]
    torch.manual_seed(5)
    batched = _run_seeded(batched_logits, params, {2: 7, 3: 8})[:, 2]
    assert torch.equal(alone, batched)
    # And the seed matters: another seed gives another sequence.
    other = _run_seeded(target, [SP(temperature=1.0, seed=8)], {0: 8})[:, 0]
    assert not torch.equal(alone, other)


def test_logprobs_are_raw_log_softmax():
    logits = _logits(5, seed=4)
    params = [SP(temperature=0.8, top_k=3, logprobs=4), SP(temperature=0.0, logprobs=0),
              SP(temperature=1.0), SP(temperature=2.0, logprobs=2), SP(temperature=0.0)]
    torch.manual_seed(4)
    out = _sample(logits, params)
    ref = torch.log_softmax(logits, -1)
    assert out.logprob_token_ids.shape == (5, 5) and out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.logprob_token_ids))
    top = ref.topk(4, -1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    want_ranks = (ref > ref.gather(1, out.sampled_token_ids[:, None])).sum(-1) + 1
    assert torch.equal(out.ranks, want_ranks)
    assert out.ranks[1].item() == 1  # greedy row samples the top token

    lp, rk = to_logprob_dicts(out, [p.logprobs for p in params])
    assert lp[2] is None and rk[2] is None and lp[4] is None
    assert lp[1] == {out.sampled_token_ids[1].item(): pytest.approx(ref[1].max().item())}
    for row in (0, 3):
        n = params[row].logprobs
        s = out.sampled_token_ids[row].item()
        assert s in lp[row] and n <= len(lp[row]) <= n + 1
        for tok, v in lp[row].items():
            assert v == pytest.approx(ref[row, tok].item(), abs=1e-6)
            assert rk[row][tok] == int((ref[row] > ref[row, tok]).sum()) + 1


def test_banned_tokens_never_sampled():
    logits = _logits(3000, seed=6)
    top2 = logits.topk(2, -1).indices
    params = [SP(temperature=0.0) if i % 3 == 0 else SP(temperature=1.0, top_k=1)
              for i in range(3000)]
    banned = [(row, top2[row, 0].item()) for row in range(3000)]
    torch.manual_seed(6)
    out = _sample(logits, params, banned=banned)
    # Bans apply before top-k: greedy and top-k=1 rows both fall to the runner-up.
    assert torch.equal(out.sampled_token_ids, top2[:, 1])


def test_min_tokens_banned_ids():
    params = [SP(min_tokens=3, stop_token_ids=[5]), SP(min_tokens=3, ignore_eos=True),
              SP(min_tokens=1, stop_token_ids=[9]), SP()]
    pairs = min_tokens_banned_ids(params, [2, 0, 1, 0], eos_token_ids=2)
    assert pairs == [(0, 2), (0, 5)]  # row 1: EOS is an ordinary token under ignore_eos
    assert min_tokens_banned_ids(params, [0, 0, 0, 0], [2, 3]) == \
        [(0, 2), (0, 3), (0, 5), (2, 2), (2, 3), (2, 9)]


def test_metadata_flags():
    md = SamplingMetadata.build([SP(temperature=0.0, top_k=5), SP(temperature=1.0, top_p=0.5,
                                                                  logprobs=3)])
    assert not md.all_greedy and not md.all_random
    assert md.no_top_k and not md.no_top_p and md.no_min_p and md.max_top_k == 0
    assert md.max_num_logprobs == 3
    md = SamplingMetadata.build([SP(temperature=0.5, top_k=7), SP(temperature=0.5, top_k=-1)])
    assert md.all_random and md.max_top_k == 7 and md.top_k.tolist() == [7, 0]


def test_bad_input_errors():
    with pytest.raises(ValueError, match="num_rows=2"):
        _sample(_logits(3), [SP()] * 2)
    with pytest.raises(ValueError, match="out of range"):
        SamplingMetadata.build([SP()], {3: torch.Generator()})
    with pytest.raises(ValueError, match="out of range"):
        SamplingMetadata.build([SP()], banned=[(1, 0)])
    with pytest.raises(ValueError, match="0 params"):
        SamplingMetadata.build([])


def test_no_nan_when_filters_remove_almost_everything():
    logits = torch.full((4, VOCAB), -math.inf)
    logits[:, 3] = 0.0
    out = _sample(logits, [SP(temperature=1.0, top_p=0.3, min_p=0.2, top_k=4)] * 4)
    assert out.sampled_token_ids.tolist() == [3] * 4


def test_banned_dominant_token_in_plain_random_rows():
    logits = torch.zeros(2000, VOCAB)
    logits[:, 0] = 20.0  # would win almost every draw
    before = logits.clone()
    torch.manual_seed(7)
    out = _sample(logits, [SP(temperature=1.0, logprobs=1)] * 2000,
                  banned=[(row, 0) for row in range(2000)])
    assert (out.sampled_token_ids != 0).all()
    assert torch.equal(logits, before)  # the caller's logits are not modified
    # Logprobs stay raw: the ban does not show in them.
    assert (out.logprob_token_ids[:, 1] == 0).all()


def test_partial_sort_top_k_top_p_matches_full_sort():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(64, 500, generator=g) * 2
    top_k = torch.randint(1, 80, (64,), generator=g, dtype=torch.int32)
    top_p = torch.rand(64, generator=g) * 0.98 + 0.01
    full = apply_top_k_top_p(logits, top_k, top_p)
    partial = apply_top_k_top_p(logits, top_k, top_p, int(top_k.max()), all_top_k=True)
    assert torch.equal(torch.isinf(full), torch.isinf(partial))
    kept = ~torch.isinf(full)
    assert torch.equal(full[kept], partial[kept])
    assert 1 < kept.sum(-1).float().mean() < 79  # both filters did something


@pytest.mark.parametrize("B", range(1, 10))
def test_row_tensors_start_16_byte_aligned(B):
    """top_p / min_p rows of the packed per-row tensor start 16-byte aligned at every batch
    size (a Triton kernel reading them would otherwise compile a variant per alignment) and
    hold the given values."""
    from kdaserve.sample.metadata import _row_tensors

    temps, top_ps, min_ps = [1.0] * B, [0.5 + i / 100 for i in range(B)], [0.1] * B
    t, p, k, m = _row_tensors(temps, top_ps, list(range(B)), min_ps, "cpu")
    for row in (t, p, m):
        assert row.data_ptr() % 16 == 0 and row.shape == (B,) and row.is_contiguous()
    assert p.tolist() == pytest.approx(top_ps) and k.tolist() == list(range(B))
    assert m.tolist() == pytest.approx(min_ps) and t.tolist() == temps
