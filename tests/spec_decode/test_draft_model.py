"""Draft-model proposer on the CPU: the tiny model drafting for itself is accepted 100% and the
speculative greedy output equals plain greedy decoding; drafts depend only on committed tokens."""

import json
import os

import pytest
import torch

from kdaserve.attention.builder import build_metadata
from kdaserve.attention.forward_context import ForwardContext
from kdaserve.config import LoadConfig
from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.models.loader import load_weights
from kdaserve.models.registry import build_model, resolve_architecture
from kdaserve.sample.metadata import SamplingMetadata
from kdaserve.spec_decode.rejection_sampler import RejectionSampler, SpecDecodeMetadata
from kdaserve.sampling_params import SamplingParams
from kdaserve.spec_decode.draft_model import DraftModelProposer
from kdaserve.spec_decode.metrics import SpecDecodingStats
from kdaserve.attention.caches import allocate_caches
from tests.models.hf_tiny import make_hf_model

BS, K = 16, 3


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    paths = []
    for seed in (0, 1):
        path = str(tmp_path_factory.mktemp(f"tiny{seed}"))
        make_hf_model(seed=seed).save_pretrained(path)
        paths.append(path)
    return paths


def _load(path):
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    args = KimiLinearArgs.from_hf_config(hf)
    model = build_model(args, torch.float32, "cpu", resolve_architecture(hf))
    load_weights(model, path, LoadConfig())
    return model, args


class Target:
    """The target model with its own caches; no rollback (the tests only verify drafts that
    are all accepted, or decode one token at a time)."""

    def __init__(self, path, n):
        self.model, self.args = _load(path)
        self.caches = allocate_caches(self.args, 64, BS, n, torch.float32, "cpu")
        self.blocks = [list(range(i * 8, (i + 1) * 8)) for i in range(n)]

    def forward(self, queries, num_computed, rows):
        """Returns logits at every query token [sum len, V]."""
        md = build_metadata([len(q) for q in queries], num_computed,
                            [self.blocks[r] for r in rows], rows, BS, "cpu")
        ids = torch.tensor([t for q in queries for t in q])
        with torch.inference_mode():
            h = self.model(ids, ForwardContext(md, self.caches))
            return self.model.compute_logits(h)


def _prompts(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 128, (int(torch.randint(3, 12, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def plain_greedy(path, prompts, steps):
    t = Target(path, len(prompts))
    n = len(prompts)
    logits = t.forward(prompts, [0] * n, list(range(n)))
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    outs = [[int(x)] for x in logits[ends].argmax(-1)]
    for _ in range(steps - 1):
        seqs = [p + o for p, o in zip(prompts, outs)]
        logits = t.forward([[o[-1]] for o in outs], [len(s) - 1 for s in seqs], list(range(n)))
        for o, x in zip(outs, logits.argmax(-1).tolist()):
            o.append(x)
    return outs


def test_self_drafting_is_fully_accepted_and_lossless(model_dirs):
    prompts = _prompts(4)
    steps = 13
    want = plain_greedy(model_dirs[0], prompts, steps)
    n = len(prompts)
    target = Target(model_dirs[0], n)
    dmodel, dargs = _load(model_dirs[0])
    prop = DraftModelProposer(dmodel, dargs, K, max_num_seqs=n, max_model_len=128,
                              block_size=BS, device="cpu", dtype=torch.float32)
    sampler = RejectionSampler()
    stats = SpecDecodingStats(K)
    logits = target.forward(prompts, [0] * n, list(range(n)))
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    outs = [[int(x)] for x in logits[ends].argmax(-1)]
    rids = [f"r{i}" for i in range(n)]
    while min(len(o) for o in outs) < steps:
        seqs = [p + o for p, o in zip(prompts, outs)]
        drafts = prop.propose(rids, seqs).draft_token_ids
        assert all(len(d) == K for d in drafts)
        logits = target.forward([[o[-1]] + d for o, d in zip(outs, drafts)],
                                [len(s) - 1 for s in seqs], list(range(n)))
        spec = SpecDecodeMetadata.make(drafts)
        md = SamplingMetadata.build([SamplingParams(temperature=0.0)] * n)
        res = sampler(logits, spec, md)
        stats.observe_batch(spec.num_draft_tokens, res.num_accepted.tolist())
        for o, toks in zip(outs, res.parse_output()):
            o.extend(toks)
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.mean_acceptance_length == K + 1
    for o, w in zip(outs, want):
        assert o[:steps] == w
    for r in rids:
        prop.free(r)
    assert len(prop._slots.free) == 2 * n and len(prop._blocks.free) == prop.caches.mla_kv[0].shape[0]


def test_drafts_depend_only_on_committed_tokens(model_dirs):
    """A different drafter: its drafts after arbitrary accept/reject steps equal those of a
    fresh proposer given the same committed tokens (rejected drafts leave no trace)."""
    prompts = _prompts(3)
    seqs = plain_greedy(model_dirs[0], prompts, 16)        # the "target's" committed tokens
    dmodel, dargs = _load(model_dirs[1])
    prop = DraftModelProposer(dmodel, dargs, K, max_num_seqs=3, max_model_len=128,
                              block_size=BS, device="cpu", dtype=torch.float32)
    committed = [1, 1, 1]
    rejected_any = False
    for step in range(5):
        toks = [p + s[:c] for p, s, c in zip(prompts, seqs, committed)]
        drafts = prop.propose(["a", "b", "c"], toks).draft_token_ids
        fresh = DraftModelProposer(dmodel, dargs, K, max_num_seqs=3, max_model_len=128,
                                   block_size=BS, device="cpu", dtype=torch.float32)
        assert fresh.propose(["a", "b", "c"], toks).draft_token_ids == drafts
        for i, d in enumerate(drafts):
            truth = seqs[i][committed[i]:committed[i] + K]
            n_acc = 0
            while n_acc < K and d[n_acc] == truth[n_acc]:
                n_acc += 1
            rejected_any |= n_acc < K
            committed[i] += n_acc + 1
    assert rejected_any


def test_probabilistic_drafts_and_caps(model_dirs):
    dmodel, dargs = _load(model_dirs[1])
    prop = DraftModelProposer(dmodel, dargs, K, max_num_seqs=2, max_model_len=128,
                              block_size=BS, device="cpu", dtype=torch.float32,
                              draft_sample_method="probabilistic")
    torch.manual_seed(0)
    out = prop.propose(["x", "y"], [[5, 6, 7], [8, 9]], temperatures=[1.0, 0.0],
                       max_drafts=[3, 2])
    assert [len(d) for d in out.draft_token_ids] == [3, 2]
    q = out.draft_probs
    assert q.shape == (5, dargs.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(5))
    flat = [t for d in out.draft_token_ids for t in d]
    assert all(q[i, t] > 0 for i, t in enumerate(flat))
    assert torch.equal(q[3:].max(-1).values, torch.ones(2))     # greedy row: one-hot
    with pytest.raises(ValueError, match="already computed"):
        prop.propose(["y"], [[8, 9]])
    with pytest.raises(ValueError, match="draft_sample_method"):
        DraftModelProposer(dmodel, dargs, K, 1, 64, BS, "cpu", torch.float32, "beam")


def test_draft_graph_inputs_match_the_eager_steps(model_dirs):
    """The graph path of drafts 2..K (buffers loaded once per propose, per-step seq lens and KV
    slots from step_inputs, padding rows on the scratch slot) gives the eager path's drafts.
    On the CPU the 'graph' runs the same forward over the same buffers without a capture."""
    from kdaserve.spec_decode.draft_graphs import DraftDecodeGraphs

    class EagerGraphs(DraftDecodeGraphs):
        def capture(self):
            pass

        @torch.inference_mode()
        def _run(self, size):
            ids = self.input_ids[:size]
            return self.model.compute_logits(
                self.model(ids, ForwardContext(self._metadata(size), self.caches)))

    prompts = _prompts(3)
    seqs = plain_greedy(model_dirs[0], prompts, 16)
    dmodel, dargs = _load(model_dirs[1])
    props = [DraftModelProposer(dmodel, dargs, 4, max_num_seqs=4, max_model_len=128,
                                block_size=BS, device="cpu", dtype=torch.float32)
             for _ in range(2)]
    g = props[1]

    def graphs(max_seqs):
        return EagerGraphs(g.model, g.caches, 2 * g.max_num_seqs, BS, g.max_blocks_per_req,
                           max_seqs, g.max_model_len, g.device)

    g.graphs = graphs(4)
    assert g.graphs.sizes == [1, 2, 4]
    committed = [1, 3, 2]
    for step, ids in enumerate([["a", "b", "c"], ["b"], ["a", "b", "c"], ["c", "a"]]):
        sel = [{"a": 0, "b": 1, "c": 2}[r] for r in ids]   # 3 rows: one padding row at size 4
        toks = [prompts[i] + seqs[i][:committed[i]] for i in sel]
        want = props[0].propose(ids, toks).draft_token_ids
        assert g.propose(ids, toks).draft_token_ids == want, step
        for i in sel:
            committed[i] += 2
    g.graphs = graphs(2)                  # three rows exceed the largest graph: eager fallback
    toks = [prompts[i] + seqs[i][:committed[i] + 1] for i in range(3)]
    assert g.propose(["a", "b", "c"], toks).draft_token_ids == \
        props[0].propose(["a", "b", "c"], toks).draft_token_ids


def test_warmup_leaves_no_trace(model_dirs):
    """The start-up warm-up gives back its slots and blocks, and later drafts equal those of a
    proposer that never warmed up."""
    prompts = _prompts(2)
    dmodel, dargs = _load(model_dirs[1])

    def make():
        return DraftModelProposer(dmodel, dargs, K, max_num_seqs=2, max_model_len=128,
                                  block_size=BS, device="cpu", dtype=torch.float32)

    warm = make()
    free = (list(warm._slots.free), list(warm._blocks.free))
    warm.warmup()
    assert (sorted(warm._slots.free), sorted(warm._blocks.free)) == \
        (sorted(free[0]), sorted(free[1]))
    assert warm.propose(["a", "b"], prompts).draft_token_ids == \
        make().propose(["a", "b"], prompts).draft_token_ids


def test_window_catchup_matches_varlen(model_dirs):
    """The window catch-up (K+1-row windows in the verify form, commit of the real tokens; the
    GPU replays it as a graph) gives the varlen baseline's drafts, and leaves every committed
    KDA state and conv window equal to the baseline's (<= 1e-5), with 1..K+1 new tokens per
    row, padding rows (3 rows at capture size 4) and rows joining with their whole prompt."""
    prompts = _prompts(3)
    seqs = plain_greedy(model_dirs[0], prompts, 24)
    dmodel, dargs = _load(model_dirs[1])
    k = 4
    win, var = (DraftModelProposer(dmodel, dargs, k, max_num_seqs=4, max_model_len=128,
                                   block_size=BS, device="cpu", dtype=torch.float32,
                                   catchup=c) for c in ("window", "varlen"))
    assert var.catchup is None and win.catchup.sizes == [1, 2, 4]
    committed = [1, 1, 1]
    steps = [["a", "b", "c"], ["a", "b", "c"], ["b"], ["c", "a"], ["a", "b", "c"]]
    advance = [[5, 1, 3], [2, 5, 4], [1], [5, 2], [3, 3, 1]]   # new tokens of the next step
    for step, (ids, adv) in enumerate(zip(steps, advance)):
        sel = [{"a": 0, "b": 1, "c": 2}[r] for r in ids]
        toks = [prompts[i] + seqs[i][:committed[i]] for i in sel]
        runs_before = win.catchup.num_runs
        got = win.propose(ids, toks).draft_token_ids
        assert got == var.propose(ids, toks).draft_token_ids, step
        assert win.catchup.num_runs == runs_before + (step > 0), step
        for rid in ids:
            a, b = win.requests[rid], var.requests[rid]
            for ca, cb in zip(win.caches.kda_recurrent, var.caches.kda_recurrent):
                torch.testing.assert_close(ca[a.slot], cb[b.slot], atol=1e-5, rtol=1e-5)
            for ca, cb in zip(win.caches.kda_conv, var.caches.kda_conv):
                torch.testing.assert_close(ca[a.slot], cb[b.slot], atol=1e-5, rtol=1e-5)
        for i, n in zip(sel, adv):
            committed[i] += n
    assert not win.catchup.can_run([k + 2], [5]) and not win.catchup.can_run([1], [0])
    assert not win.catchup.can_run([1] * 5, [3] * 5)
    for r in ("a", "b", "c"):
        win.free(r)
    assert sorted(win._slots.free) == list(range(8))


def test_sample_drafts_follow_q():
    """The exponential-race draw of probabilistic drafts: counts over many rows match q (a
    chi-square bound far in the tail), zero-probability ids never come out, T = 0 rows take
    the argmax with a one-hot q, greedy returns no q."""
    from kdaserve.spec_decode.draft_model import sample_drafts

    torch.manual_seed(0)
    n, V = 20000, 6
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, float("-inf"), 0.5]).repeat(n, 1)
    temps = torch.full((n,), 0.8)
    temps[:10] = 0.0
    ids, q = sample_drafts(logits, temps, "probabilistic")
    assert (ids[:10] == 3).all() and torch.equal(q[0], torch.nn.functional.one_hot(
        torch.tensor(3), V).float())
    want = torch.softmax(logits[0] / 0.8, -1)
    assert torch.allclose(q[10], want)
    counts = torch.bincount(ids[10:], minlength=V).double()
    assert counts[4] == 0                                   # -inf logit: probability 0
    exp = want.double() * (n - 10)
    keep = exp > 0
    chi2 = float((((counts - exp) ** 2)[keep] / exp[keep]).sum())
    assert chi2 < 25.0, (chi2, counts.tolist(), exp.tolist())   # 4 dof: p ~ 5e-5
    g, none = sample_drafts(logits[:3], temps[:3], "greedy")
    assert none is None and (g == 3).all()
