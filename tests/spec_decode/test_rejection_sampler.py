import pytest
import torch

from kdaserve.sample.metadata import SamplingMetadata
from kdaserve.spec_decode.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
    SpecDecodeMetadata,
    spec_banned_ids,
    spec_logprob_dicts,
)
from kdaserve.sample.sampler import Sampler
from kdaserve.sampling_params import SamplingParams as SP
from kdaserve.config.synthetic import rates_from_length
from tests.stats import chi2_pvalue


def _run(logits_per_pos, drafts, params, draft_probs=None, method="standard", rates=None,
         generators=None, device="cpu"):
    """logits_per_pos: [K+1, V] shared by every request; drafts: [N, K]. device cuda: the
    engine's CUDA sampler (threshold search, fused race and split softmax); the outputs come
    back on the CPU."""
    N = drafts.shape[0]
    spec = SpecDecodeMetadata.make(drafts.tolist(), device=device)
    logits = logits_per_pos.repeat(N, 1).to(device)
    md = SamplingMetadata.build(params * N if len(params) == 1 else params, generators,
                                device=device)
    cuda = device != "cpu"
    out = RejectionSampler(method, rates, threshold_kernel=cuda, race_kernel=cuda)(
        logits, spec, md, None if draft_probs is None else draft_probs.to(device))
    if cuda:
        out.output_token_ids = out.output_token_ids.cpu()
        out.num_accepted = out.num_accepted.cpu()
        out.accepted_per_position = out.accepted_per_position.cpu()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["standard", "synthetic"])
@pytest.mark.parametrize("params", [SP(temperature=1.0), SP(temperature=0.8, top_p=0.8)])
def test_cuda_sampler_follows_target(method, params):
    """The CUDA path (split softmax for standard acceptance, the fused race for synthetic
    candidates, top-p as the threshold): the emitted tokens follow the filtered target."""
    torch.manual_seed(11)
    V, K, N = 6, 2, 30000
    logits = torch.randn(K + 1, V) * 1.5
    q = torch.softmax(torch.randn(K, V) * 1.5, dim=-1)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True) for j in range(K)], 1)
    rates = [0.6, 0.3] if method == "synthetic" else None
    out = _run(logits, drafts, [params], q.repeat(N, 1), method, rates, device="cuda")
    scaled = logits / params.temperature
    if params.top_p < 1:
        from kdaserve.sample.sampler import apply_top_k_top_p

        scaled = apply_top_k_top_p(scaled, None, torch.full((K + 1,), params.top_p))
    target = torch.softmax(scaled, -1)
    if method == "standard":
        _emitted_distribution_check(out, target, K)
    else:   # the token after the accepted drafts is a draw from the target at that position
        for j in range(K + 1):
            tok = out.output_token_ids[out.num_accepted == j, j]
            assert chi2_pvalue(torch.bincount(tok, minlength=V), target[j]) > 0.01


def _emitted_distribution_check(out, target_probs, K):
    """Token at emitted position j, among requests that emitted >= j + 1 tokens, ~ p_j."""
    toks = out.output_token_ids
    V = target_probs.shape[1]
    for j in range(K + 1):
        col = toks[:, j]
        col = col[col != PLACEHOLDER_TOKEN_ID]
        assert col.numel() > 500, f"too few samples at position {j}: {col.numel()}"
        counts = torch.bincount(col, minlength=V)
        p = chi2_pvalue(counts, target_probs[j])
        assert p > 0.01, f"position {j}: chi-square p = {p:.4g}, counts {counts.tolist()}"


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.8, 4)])
def test_standard_with_draft_probs_follows_target(temperature, top_k):
    torch.manual_seed(1)
    V, K, N = 6, 2, 30000
    logits = torch.randn(K + 1, V) * 1.5
    q = torch.softmax(torch.randn(K, V) * 1.5, dim=-1)                # [K, V]
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True) for j in range(K)], 1)
    draft_probs = q.repeat(N, 1)                                       # [N*K, V]
    out = _run(logits, drafts, [SP(temperature=temperature, top_k=top_k)], draft_probs)
    scaled = logits / temperature
    if top_k:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    _emitted_distribution_check(out, torch.softmax(scaled, -1), K)
    # acceptance rate at position 0 is sum min(p, q)
    p0 = torch.softmax(scaled, -1)[0]
    alpha = torch.minimum(p0, q[0]).sum().item()
    rate = out.accepted_per_position[0].item() / N
    assert abs(rate - alpha) < 0.02


def test_one_hot_drafts_follow_target():
    """draft_probs None (n-gram / greedy drafts): accept with p(x), recover from p minus x."""
    torch.manual_seed(2)
    V, K, N = 5, 3, 30000
    logits = torch.randn(K + 1, V) * 1.2
    # drafts from a distribution near p (the sampler never sees it: q is one-hot)
    near = torch.softmax(logits[:K] + 0.5 * torch.randn(K, V), -1)
    drafts = torch.stack([torch.multinomial(near[j], N, replacement=True) for j in range(K)], 1)
    out = _run(logits, drafts, [SP(temperature=1.0)])
    _emitted_distribution_check(out, torch.softmax(logits, -1), K)


def _greedy_reference(logits, drafts_list):
    outs, row = [], 0
    for d in drafts_list:
        am = logits[row:row + len(d) + 1].argmax(-1).tolist()
        emitted = []
        for j, x in enumerate(d):
            if x != am[j]:
                emitted.append(am[j])
                break
            emitted.append(x)
        else:
            emitted.append(am[len(d)])
        outs.append(emitted)
        row += len(d) + 1
    return outs


def test_greedy_exact_and_mixed_lengths():
    g = torch.Generator().manual_seed(3)
    V = 50
    drafts_list = [[], [1, 2, 3], [4], [], [5, 6]]
    R = sum(len(d) + 1 for d in drafts_list)
    logits = torch.randn(R, V, generator=g)
    # make some drafts equal to the argmax so that prefixes get accepted
    row = 0
    for i, d in enumerate(drafts_list):
        for j in range(len(d)):
            if (i + j) % 3 != 2:
                d[j] = int(logits[row + j].argmax())
        row += len(d) + 1
    spec = SpecDecodeMetadata.make(drafts_list)
    md = SamplingMetadata.build([SP(temperature=0.0)] * len(drafts_list))
    out = RejectionSampler()(logits, spec, md)
    assert out.parse_output() == _greedy_reference(logits, drafts_list)
    assert out.output_token_ids.shape == (5, 4)
    ref = _greedy_reference(logits, drafts_list)
    assert out.num_accepted.tolist() == [len(r) - 1 for r in ref]
    per_pos = [sum(1 for r in ref if len(r) - 1 > j) for j in range(3)]
    assert out.accepted_per_position.tolist() == per_pos


def test_greedy_rows_in_random_batch():
    """Greedy rows stay exact while random rows share the batch."""
    g = torch.Generator().manual_seed(4)
    V = 30
    drafts_list = [[0, 1], [2, 3], [4, 5], [6, 7]]
    logits = torch.randn(12, V, generator=g)
    for i in (0, 2):
        drafts_list[i][0] = int(logits[3 * i].argmax())
    params = [SP(temperature=0.0), SP(temperature=1.0), SP(temperature=0.0), SP(temperature=0.7)]
    spec = SpecDecodeMetadata.make(drafts_list)
    out = RejectionSampler()(logits, spec, SamplingMetadata.build(params))
    got = out.parse_output()
    ref = _greedy_reference(logits, drafts_list)
    assert got[0] == ref[0] and got[2] == ref[2]
    assert all(1 <= len(t) <= 3 for t in got)


def test_seeded_rows_are_deterministic_and_batch_independent():
    V = 40
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(9, V, generator=g)
    drafts = [[1, 2], [3, 4], [5, 6]]

    def run(seed_rows, batch_noise_seed):
        torch.manual_seed(batch_noise_seed)
        gens = {r: torch.Generator().manual_seed(100 + r) for r in seed_rows}
        spec = SpecDecodeMetadata.make(drafts)
        md = SamplingMetadata.build([SP(temperature=1.0, seed=1)] * 3, gens)
        return RejectionSampler()(logits, spec, md).parse_output()

    a = run([1], 0)
    b = run([1], 1)
    assert a[1] == b[1]                       # seeded row ignores the global stream
    c = run([0, 1, 2], 7)
    assert c[1] == a[1]                       # ...and the other rows' seeds


def test_no_draft_seeded_row_matches_sampler():
    """A request with K = 0 is plain sampling: same tokens as the Sampler with the same seed."""
    V = 100
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(6))
    params = [SP(temperature=0.9, top_p=0.9, seed=3)] * 4
    gens1 = {i: torch.Generator().manual_seed(10 + i) for i in range(4)}
    gens2 = {i: torch.Generator().manual_seed(10 + i) for i in range(4)}
    a = Sampler()(logits, SamplingMetadata.build(params, gens1)).sampled_token_ids.tolist()
    spec = SpecDecodeMetadata.make([[]] * 4)
    out = RejectionSampler()(logits, spec, SamplingMetadata.build(params, gens2))
    assert [t[0] for t in out.parse_output()] == a
    assert out.output_token_ids.shape == (4, 1)
    assert out.accepted_per_position.numel() == 0


@pytest.mark.parametrize("length,K", [(3.5, 4), (1.0, 3), (5.0, 4), (2.3, 8)])
def test_synthetic_mean_acceptance_length(length, K):
    torch.manual_seed(7)
    N, V = 20000, 8
    rates = rates_from_length(length, K)
    logits = torch.randn(K + 1, V)
    drafts = torch.randint(0, V, (N, K))
    out = _run(logits, drafts, [SP(temperature=0.0)], method="synthetic", rates=rates)
    mean_len = (out.num_accepted.double().mean() + 1).item()
    assert abs(mean_len - length) < 0.03
    # minimum-variance schedule: the accepted count takes at most two values
    assert out.num_accepted.unique().numel() <= 2
    # accepted tokens are the drafts; the token after is the target's (argmax here)
    toks = out.output_token_ids
    n = out.num_accepted
    for i in range(50):
        assert toks[i, :n[i]].tolist() == drafts[i, :n[i]].tolist()
        assert toks[i, n[i]].item() == logits[n[i]].argmax().item()


def test_synthetic_explicit_rates_per_position():
    torch.manual_seed(8)
    N, V, K = 20000, 8, 3
    rates = [0.8, 0.5, 0.2]
    logits = torch.randn(K + 1, V)
    drafts = torch.randint(0, V, (N, K))
    out = _run(logits, drafts, [SP(temperature=1.0)], method="synthetic", rates=rates)
    per_pos = (out.accepted_per_position.double() / N).tolist()
    for got, want in zip(per_pos, rates):
        assert abs(got - want) < 0.015
    # the token after the accepted drafts is sampled from the target
    first = out.output_token_ids[:, 0][out.num_accepted == 0]
    counts = torch.bincount(first, minlength=V)
    assert chi2_pvalue(counts, torch.softmax(logits[0], -1)) > 0.01


def test_bans_per_position_and_per_request():
    V = 10
    logits = torch.zeros(4, V)
    logits[:, 3] = 50.0                     # token 3 dominates everywhere
    drafts = [[3, 3, 3]]
    # min_tokens = 2 with 0 outputs so far: rows 0 and 1 ban token 3, rows 2 and 3 allow it
    banned = spec_banned_ids([2], [0], [{3}], [3])
    assert banned == [(0, 3), (1, 3)]
    spec = SpecDecodeMetadata.make(drafts, banned=banned)
    md = SamplingMetadata.build([SP(temperature=0.0)])
    out = RejectionSampler()(logits, spec, md).parse_output()
    assert out[0][0] != 3 and len(out[0]) == 1
    # request-level ban (SamplingMetadata) applies at every position
    spec2 = SpecDecodeMetadata.make([[]])
    md2 = SamplingMetadata.build([SP(temperature=0.0)], banned=[(0, 3)])
    assert RejectionSampler()(logits[:1], spec2, md2).parse_output()[0][0] != 3


def test_logprobs_of_emitted_tokens():
    V = 20
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(9))
    d0 = int(logits[0].argmax())
    spec = SpecDecodeMetadata.make([[d0, 0]])
    md = SamplingMetadata.build([SP(temperature=0.0, logprobs=2)])
    out = RejectionSampler()(logits, spec, md)
    toks = out.parse_output()[0]
    lps = spec_logprob_dicts(out, spec, [2])[0]
    assert len(lps) == len(toks)
    raw = torch.log_softmax(logits, -1)
    for j, (tok, (lp, rank)) in enumerate(zip(toks, lps)):
        assert lp[tok] == pytest.approx(raw[j, tok].item(), abs=1e-6)
        assert rank[tok] == 1                  # greedy tokens are the top-1


def test_bad_inputs():
    spec = SpecDecodeMetadata.make([[1, 2]])
    md = SamplingMetadata.build([SP()])
    with pytest.raises(ValueError, match="target_logits"):
        RejectionSampler()(torch.zeros(2, 5), spec, md)
    with pytest.raises(ValueError, match="draft_probs"):
        RejectionSampler()(torch.zeros(3, 5), spec, md, torch.zeros(1, 5))
    with pytest.raises(ValueError, match="rejection_sample_method"):
        RejectionSampler("block")
    with pytest.raises(ValueError, match="non-increasing"):
        RejectionSampler("synthetic", [0.2, 0.5])
    with pytest.raises(ValueError, match=">= 0"):
        SpecDecodeMetadata.make([[-1]])
    with pytest.raises(ValueError, match="synthetic rates"):
        RejectionSampler("synthetic", [0.5])(torch.zeros(3, 5), spec, md)
