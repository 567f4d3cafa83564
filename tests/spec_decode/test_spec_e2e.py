"""Greedy speculative decoding over the tiny model equals plain greedy decoding: each proposer,
both KDA state modes (RecoverSSM, per-position), both batch layouts (contiguous views,
index_select / index_copy_), mixed spec / non-spec / prefill rows in one batch. Afterwards every
request's KDA state equals a plain run's over its accepted tokens."""

import pytest
import torch

from kdaserve.attention.builder import build_metadata
from kdaserve.attention.forward_context import ForwardContext
from kdaserve.spec_decode.draft_model import DraftModelProposer
from kdaserve.spec_decode.ngram import NgramProposer
from kdaserve.attention.caches import allocate_caches
from tests.models.hf_tiny import make_hf_model
from tests.spec_decode.spec_harness import BS, SpecHarness, load_model

K = 3
MAX_TOKENS = [60, 45, 60, 50, 20]
DRAFT_NOISE = 0.3
"""The draft model is the target with N(0, (0.3 * std)^2) added to every weight: it agrees with
the target often, not always, so steps see both accepts and rejects."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = []
    for noise in (0.0, DRAFT_NOISE):
        path = str(tmp_path_factory.mktemp("e2e"))
        hf = make_hf_model(seed=0)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in hf.parameters():
                if noise and p.numel() > 1:
                    p.add_(torch.randn(p.shape, generator=g) * p.std() * noise)
        hf.save_pretrained(path)
        out.append(load_model(path))
    return out


def _prompts():
    # the tiny model's greedy continuations of these fall into repeated spans within ~40 tokens,
    # so prompt lookup sees both matches that hold and matches that do not
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 128, (5,), generator=g).tolist() for _ in range(5)]


def _run(models, proposer_kind, state_mode, contiguous):
    model, args = models[0]
    if proposer_kind == "none":
        proposer, k = None, 0
    elif proposer_kind == "ngram":
        proposer, k = NgramProposer(K, 1, 3), K
    else:
        dmodel, dargs = models[1]
        proposer = DraftModelProposer(dmodel, dargs, K, max_num_seqs=8, max_model_len=128,
                                      block_size=BS, device="cpu", dtype=torch.float32)
        k = K
    h = SpecHarness(model, args, k, state_mode, contiguous, proposer)
    prompts = _prompts()
    # staggered arrivals: prefills share steps with spec and plain decode rows
    pending = list(enumerate(zip(prompts, MAX_TOKENS)))
    h.add("r0", prompts[0], MAX_TOKENS[0])
    pending.pop(0)
    while any(not r.done for r in h.reqs) or pending:
        if pending:
            i, (p, m) = pending.pop(0)
            h.add(f"r{i}", p, m)
        if any(not r.done for r in h.reqs):
            h.step()
    return h


@pytest.fixture(scope="module")
def plain(models):
    h = _run(models, "none", "recover", True)
    return {r.rid: r.out for r in h.reqs}


def _kda_state_of_plain_run(models, tokens):
    """Prefill `tokens` in one pass; returns per-layer (recurrent, conv) states."""
    model, args = models[0]
    caches = allocate_caches(args, 8, BS, 1, torch.float32, "cpu")
    md = build_metadata([len(tokens)], [0], [list(range(8))], [0], BS, "cpu")
    ids = torch.tensor(tokens)
    with torch.inference_mode():
        model(ids, ForwardContext(md, caches))
    return [(r[0].clone(), c[0].clone()) for r, c in zip(caches.kda_recurrent, caches.kda_conv)]


@pytest.mark.parametrize("proposer_kind", ["ngram", "draft"])
@pytest.mark.parametrize("state_mode", ["recover", "per_position"])
@pytest.mark.parametrize("contiguous", [True, False])
def test_spec_greedy_equals_plain(models, plain, proposer_kind, state_mode, contiguous):
    h = _run(models, proposer_kind, state_mode, contiguous)
    got = {r.rid: r.out for r in h.reqs}
    assert got == plain
    st = h.stats
    assert st.num_drafts > 0, "no step verified drafts"
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, \
        f"need both accepts and rejects, got {st.as_dict()}"
    # the KDA state and conv window equal a plain run over exactly the accepted tokens
    for r in h.reqs[:3]:
        want = _kda_state_of_plain_run(models, r.tokens[:r.num_computed])
        for layer, (rec_w, conv_w) in enumerate(want):
            rec = h.caches.kda_recurrent[layer][r.slots[0]]
            conv = h.caches.kda_conv[layer][r.slots[0]]
            torch.testing.assert_close(rec, rec_w, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(conv, conv_w, atol=1e-5, rtol=1e-5)
