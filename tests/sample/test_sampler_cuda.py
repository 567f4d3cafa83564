"""The sampler on a GPU: no host sync in forward, seeded rows batch-invariant with CUDA generators."""

import pytest
import torch

from kdaserve.sample.metadata import SamplingMetadata
from kdaserve.sample.sampler import Sampler
from kdaserve.sampling_params import SamplingParams as SP

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
VOCAB = 32000


def _params(batch):
    return [SP(temperature=0.0, logprobs=2) if i % 4 == 0 else
            SP(temperature=0.7, top_k=40 + i, top_p=0.9, min_p=0.02, seed=i) if i % 4 == 1 else
            SP(temperature=1.1, top_p=0.8) if i % 4 == 2 else SP(temperature=0.9, logprobs=5)
            for i in range(batch)]


@pytest.mark.parametrize("race", [False, True])
def test_forward_has_no_host_sync(race):
    params = _params(32)
    gens = {i: torch.Generator(device=DEV).manual_seed(p.seed)
            for i, p in enumerate(params) if p.seed is not None}
    md = SamplingMetadata.build(params, gens, [(i, 3) for i in range(0, 32, 5)], device=DEV)
    logits = torch.randn(32, VOCAB, device=DEV, dtype=torch.bfloat16) * 3
    sampler = Sampler(threshold_kernel=True, race_kernel=race)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, md)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ids = out.sampled_token_ids.cpu()
    assert (ids[0::5] != 3).all()
    assert torch.equal(ids[0::4], logits.float()[0::4].argmax(-1).cpu())
    ref = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.logprob_token_ids))


@pytest.mark.parametrize("race", [False, True])
def test_seeded_row_batch_invariant_on_cuda(race):
    target = [torch.randn(1, VOCAB, device=DEV) * 2 for _ in range(12)]
    sampler = Sampler(threshold_kernel=True, race_kernel=race)

    def run(rows, params, seeds):
        gens = {r: torch.Generator(device=DEV).manual_seed(s) for r, s in seeds.items()}
        md = SamplingMetadata.build(params, gens, device=DEV)
        return torch.stack([sampler(lg, md).sampled_token_ids for lg in rows]).cpu()

    seeded = SP(temperature=1.0, top_p=0.95, seed=11)
    alone = run(target, [seeded], {0: 11})[:, 0]
    others = [torch.cat([torch.randn(3, VOCAB, device=DEV), t]) for t in target]
    batched = run(others, [SP(), SP(top_k=5), SP(seed=4), seeded], {2: 4, 3: 11})[:, 3]
    assert torch.equal(alone, batched)


def test_threshold_kernel_matches_the_sort():
    """apply_top_k_top_p through the sort-free threshold kernel keeps the sort's tokens (plus at
    most ties within ~1 ulp of the boundary), and seeded sampling picks the same tokens."""
    from kdaserve.sample.sampler import apply_top_k_top_p

    g = torch.Generator(device=DEV).manual_seed(0)
    B, V = 16, 163840
    logits = torch.randn(B, V, device=DEV, generator=g) * 2
    top_k = torch.tensor([0, 50, 0, 1000] * 4, device=DEV)
    top_p = torch.tensor([0.95, 1.0, 0.5, 0.9] * 4, device=DEV)
    for k, p in ((top_k, top_p), (None, top_p), (top_k, None)):
        want = apply_top_k_top_p(logits, k, p) > float("-inf")
        got = apply_top_k_top_p(logits, k, p, threshold_kernel=True) > float("-inf")
        assert (want & ~got).sum() == 0, "the kernel dropped a kept token"
        extra = got & ~want
        assert extra.sum() <= 2 * B, int(extra.sum())
    params = [SP(temperature=1.0, top_p=0.95, seed=i) for i in range(B)]
    ids = []
    for kernel in (False, True):
        gens = {i: torch.Generator(device=DEV).manual_seed(i) for i in range(B)}
        md = SamplingMetadata.build(params, gens, None, device=DEV)
        ids.append(Sampler(threshold_kernel=kernel)(logits, md).sampled_token_ids)
    assert (ids[0] != ids[1]).sum() <= 1


@pytest.mark.parametrize("params", [SP(temperature=0.8, top_p=0.9), SP(temperature=1.3),
                                    SP(temperature=1.0, top_k=6, top_p=0.95, min_p=0.05)])
def test_race_draws_follow_the_filtered_softmax(params):
    """The race path's draws of one row (4000 rows, unseeded) against the sort path's filtered
    softmax: nothing outside the kept set, counts consistent with the probabilities."""
    from kdaserve.sample.sampler import apply_min_p, apply_top_k_top_p
    from tests.stats import chi2_pvalue

    n, V = 4000, 4096
    row = torch.full((V,), -20.0, device=DEV)
    row[torch.arange(0, V, 512, device=DEV)] = torch.linspace(-1.0, 2.0, 8, device=DEV)
    md = SamplingMetadata.build([params] * n, {}, None, device=DEV)
    got = Sampler(threshold_kernel=True, race_kernel=True)(row.repeat(n, 1), md)
    t = params.temperature
    k = torch.tensor([params.top_k], device=DEV) if params.top_k > 0 else None
    p = torch.tensor([params.top_p], device=DEV) if params.top_p < 1 else None
    filt = apply_top_k_top_p((row / t)[None], k, p, max(params.top_k, 0), k is not None)
    if params.min_p > 0:
        filt = apply_min_p(filt, torch.tensor([params.min_p], device=DEV))
    probs = torch.softmax(filt[0], 0)
    counts = torch.bincount(got.sampled_token_ids, minlength=V)
    assert counts[probs == 0].sum() == 0
    assert chi2_pvalue(counts, probs) > 1e-4
