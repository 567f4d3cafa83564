"""Speculative decoding in the real engine (LLM / LLMEngine on the tiny model, CPU fp32).

Greedy output with each proposer (n-gram; draft model: the target itself and a perturbed copy)
equals greedy output without speculation, in both KDA state modes (RecoverSSM, per-position) and
both batch layouts (contiguous, gather), with spec rows, plain decodes and prefills in the same
steps; seeded sampling is reproducible; synthetic acceptance hits its set length; prefix
checkpoints taken at spec rows restore exact states; every pool ends free (make_llm checks)."""

from __future__ import annotations

import pytest
import torch

from kdaserve import SamplingParams
from kdaserve.config import SpeculativeConfig
from tests.models.hf_tiny import make_hf_model

K = 3
MODES = [("recover", "contiguous"), ("recover", "gather"), ("per_position", "contiguous"),
         ("per_position", "gather")]


def _prompts() -> list[list[int]]:
    """Repetitive prompts (n-gram matches from the first step) and random ones (matches only
    once the tiny model's greedy output starts repeating, some of which hold)."""
    g = torch.Generator().manual_seed(0)
    rand = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 9, 5, 30)]
    return [[5, 6, 7, 8] * 4, rand[0], [40, 41, 42] * 6 + [7], rand[1], rand[2], rand[3]]


MAX_TOKENS = [40, 50, 30, 45, 60, 25]


def _run(llm, prompts=None, params=None, stagger: int = 3):
    """Requests arrive every `stagger` steps, so prefills share steps with decode and spec rows.
    Returns (token ids per request, whether some step mixed spec rows with other rows)."""
    eng = llm.llm_engine
    prompts = prompts or _prompts()
    params = params or [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                        for m in MAX_TOKENS]
    runner = eng.model_runner
    mixed, launch = [], runner.launch

    def record(so):
        specs = so.scheduled_spec_decode_tokens
        mixed.append(bool(specs) and len(specs) < len(so.num_scheduled_tokens))
        return launch(so)
    runner.launch = record
    pending = list(enumerate(prompts))
    outs, step = {}, 0
    while pending or eng.has_unfinished_requests():
        if pending and step % stagger == 0:
            i, p = pending.pop(0)
            eng.add_request(f"r{i}", p, params[i])
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        step += 1
    runner.launch = launch
    return [outs[f"r{i}"] for i in range(len(prompts))], any(mixed)


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    """A perturbed copy of the tiny model: agrees with it often, not always."""
    path = str(tmp_path_factory.mktemp("draft"))
    hf = make_hf_model(seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.3)
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_dir):
    from kdaserve import LLM

    llm = LLM(tiny_model_dir, max_model_len=512, num_gpu_blocks=256,
              max_num_batched_tokens=512)
    return _run(llm)[0]


def _spec(**kw) -> dict:
    return {"method": "ngram", "num_speculative_tokens": K, **kw}


@pytest.mark.parametrize("state_mode,layout", MODES)
def test_ngram_greedy_equals_plain(make_llm, plain_outputs, state_mode, layout):
    llm = make_llm(speculative_config=_spec(kda_state_mode=state_mode, batch_layout=layout))
    got, mixed = _run(llm)
    assert got == plain_outputs
    assert mixed, "no step mixed spec rows with other rows"
    st = llm.llm_engine.spec_decoding_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st.as_dict()
    stats = llm.llm_engine.get_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
            stats.spec_kda_state_bytes_written) == \
        (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.kda_state_bytes_written)
    _check_state_bytes(llm, st, state_mode)


def _check_state_bytes(llm, st, state_mode: str) -> None:
    """Each verify step writes at least 2 window tokens' worth: per_position 2 full states,
    recover 2 records + the committed state."""
    from kdaserve.kernels.kda.recover import spec_state_bytes_written

    spec = llm.llm_engine.model_runner.spec
    least = spec_state_bytes_written(state_mode, *spec._kda_dims, window=2, num_accepted=1,
                                     conv_dtype_bytes=spec.conv_dtype_bytes)
    most = spec_state_bytes_written(state_mode, *spec._kda_dims, window=1 + K,
                                    num_accepted=1 + K, conv_dtype_bytes=spec.conv_dtype_bytes)
    assert st.num_drafts * least <= st.kda_state_bytes_written <= st.num_drafts * most


@pytest.mark.parametrize("state_mode,layout", [MODES[0], MODES[3]])
def test_draft_model_greedy_equals_plain(make_llm, plain_outputs, tiny_model_dir, draft_dirs,
                                         state_mode, layout):
    # the target drafting for itself: every draft is accepted
    llm = make_llm(speculative_config=_spec(method="draft_model", model=tiny_model_dir,
                                            kda_state_mode=state_mode, batch_layout=layout))
    got, _ = _run(llm)
    assert got == plain_outputs
    st = llm.llm_engine.spec_decoding_stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens
    # a perturbed drafter: accepts and rejects, still the target's greedy output
    llm = make_llm(speculative_config=_spec(method="draft_model", model=draft_dirs,
                                            kda_state_mode=state_mode, batch_layout=layout,
                                            draft_sample_method="probabilistic"))
    got, _ = _run(llm)
    assert got == plain_outputs
    st = llm.llm_engine.spec_decoding_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st.as_dict()
    _assert_drafter_free(llm)


def _assert_drafter_free(llm) -> None:
    """The last finished ids reach the worker with the next step; then no draft state is left."""
    eng = llm.llm_engine
    if eng.scheduler.has_finished_requests():
        eng.step()
    assert not eng.model_runner.spec.proposer.requests, "draft model state leaked"


def test_preemption_with_spec_decode(make_llm, plain_outputs, tiny_model_dir):
    """Few KV blocks: requests are preempted and resumed mid-generation (drafts dropped, draft
    model state freed); the output is still the plain greedy output."""
    llm = make_llm(max_model_len=128, num_gpu_blocks=12,
                   speculative_config=_spec(method="draft_model", model=tiny_model_dir))
    got, _ = _run(llm, stagger=1)
    assert got == plain_outputs
    assert llm.llm_engine.get_stats().num_preemptions > 0
    _assert_drafter_free(llm)


def test_seeded_sampling_reproducible(make_llm):
    prompts = _prompts()
    params = [SamplingParams(temperature=0.05, seed=100 + i, max_tokens=m, ignore_eos=True,
                             logprobs=2) for i, m in enumerate(MAX_TOKENS)]
    llm = make_llm(speculative_config=_spec())
    runs = [llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for _ in range(2)]
    toks = [[o.outputs[0].token_ids for o in run] for run in runs]
    assert toks[0] == toks[1]
    for o, m in zip(runs[0], MAX_TOKENS):
        assert len(o.outputs[0].token_ids) == m
        assert len(o.outputs[0].logprobs) == m
        for tok, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs):
            assert tok in lp
    st = llm.llm_engine.spec_decoding_stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0, st.as_dict()
    # a seeded request's tokens do not depend on the rest of the batch
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], params[0], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == toks[0][0]


def test_greedy_logprobs_match_plain(make_llm):
    prompts = _prompts()[:3]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3)
    results = []
    for spec in (None, _spec()):
        llm = make_llm(speculative_config=spec)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([o.outputs[0] for o in outs])
    for plain, spec in zip(*results):
        assert plain.token_ids == spec.token_ids
        for a, b in zip(plain.logprobs, spec.logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].rank == b[t].rank
                assert abs(a[t].logprob - b[t].logprob) < 1e-4


def test_synthetic_acceptance_length(make_llm):
    llm = make_llm(speculative_config=_spec(num_speculative_tokens=4,
                                            rejection_sample_method="synthetic",
                                            synthetic_acceptance_length=2.5))
    _run(llm, params=[SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)] * 6)
    st = llm.llm_engine.spec_decoding_stats
    assert st.synthetic and st.num_drafts > 50
    assert abs(st.mean_acceptance_length - 2.5) < 0.25, st.as_dict()


@pytest.mark.parametrize("state_mode", ["recover", "per_position"])
def test_prefix_checkpoints_at_spec_rows(make_llm, state_mode):
    """Checkpoints every block: during decode they land on spec rows (the state after the last
    known token, exported at the commit). A follow-up prompt that extends a finished request's
    tokens hits them and generates exactly what a cache-off engine generates."""
    first = [[5, 6, 7, 8] * 4, [40, 41, 42] * 6 + [7]]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = []
    for spec, cache in ((_spec(kda_state_mode=state_mode), True), (None, False)):
        llm = make_llm(speculative_config=spec, enable_prefix_caching=cache,
                       kda_checkpoint_interval=16)
        outs = llm.generate([{"prompt_token_ids": p} for p in first], greedy, use_tqdm=False)
        follow = [p + o.outputs[0].token_ids[:30] + [9, 10] for p, o in zip(first, outs)]
        outs2 = llm.generate([{"prompt_token_ids": p} for p in follow], greedy, use_tqdm=False)
        results.append(([o.outputs[0].token_ids for o in outs + outs2],
                        [o.num_cached_tokens for o in outs2]))
    assert results[0][0] == results[1][0]
    assert all(c >= 32 for c in results[0][1]), results[0][1]


@pytest.mark.parametrize("kwargs,field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "x"},
     "draft_sample_method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "x"},
     "rejection_sample_method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "kda_state_mode": "x"}, "kda_state_mode"),
    ({"method": "ngram", "num_speculative_tokens": 2, "batch_layout": "x"}, "batch_layout"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"},
     "synthetic_acceptance"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_length": 4.0}, "synthetic_acceptance_length"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig(**kwargs)


def test_synthetic_rates_resolved():
    sc = SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                           rejection_sample_method="synthetic", synthetic_acceptance_length=2.5)
    assert sc.synthetic_rates == [1.0, 0.5, 0.0]


def test_spec_verify_graph_inputs_match_the_eager_steps(make_llm, plain_outputs,
                                                        tiny_model_dir, draft_dirs):
    """The spec-verify CUDA-graph path (buffers, in-graph MLA rows, padding requests on the
    scratch slot, the padded commit) gives the plain greedy output. On the CPU the 'graph' runs
    the captured work eagerly over the same buffers."""
    from kdaserve.spec_decode.verify_graphs import SpecVerifyGraphs
    from kdaserve.worker.cuda_graphs import CudaGraphManager

    class EagerSpecGraphs(SpecVerifyGraphs):
        def capture(self):
            self.mds = {bs: self._metadata(bs) for bs in self.sizes}

        def _run(self, bs):
            md = self.mds[bs]
            return self._forward(bs, md), md.spec

        def _replay_commit(self, bs, step):
            self.commits += 1
            self._commit_work(bs, step)

    # a draft model proposes K drafts every step, so most verification steps are uniform; the
    # perturbed drafter gets some rejected (the commit must fold only the accepted tokens)
    for draft in (tiny_model_dir, draft_dirs):
        llm = make_llm(speculative_config=_spec(method="draft_model", model=draft,
                                                kda_state_mode="recover",
                                                batch_layout="contiguous"), max_num_seqs=8)
        runner = llm.llm_engine.model_runner
        runner.graphs = CudaGraphManager(8, pdl=False)   # the CPU run keeps no graphs
        vg = runner.spec.verify_graphs = EagerSpecGraphs(
            runner.graphs, runner.model, runner.caches, runner.spec.k, runner.num_slots,
            runner.block_size, runner.config.scheduler_config.max_model_len, runner.device)
        vg.capture()
        vg.commits = 0
        got, _ = _run(llm)
        assert got == plain_outputs
        assert vg.num_replays >= 10, vg.num_replays
        assert vg.commits == vg.num_replays
    # the per-position state mode has no verification graphs (they read the pool read-only)
    runner = make_llm(speculative_config=_spec(kda_state_mode="per_position")
                      ).llm_engine.model_runner
    runner.spec.capture_graphs(CudaGraphManager(8, pdl=False), runner.model, runner.caches,
                               runner.num_slots, runner.block_size)
    assert runner.spec.verify_graphs is None


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_disable_by_batch_size(make_llm, plain_outputs, tiny_model_dir, draft_dirs, method):
    """No drafts are proposed in steps of >= disable_by_batch_size requests; speculation
    resumes when the batch shrinks (the draft model catching up on the skipped tokens), and the
    greedy output still equals plain decoding."""
    extra = {"model": draft_dirs} if method == "draft_model" else {}
    llm = make_llm(speculative_config=_spec(method=method, disable_by_batch_size=3, **extra))
    spec = llm.llm_engine.model_runner.spec
    calls, propose = [], spec.propose

    def record(states, num_reqs=None):
        out = propose(states, num_reqs)
        calls.append((num_reqs, bool(out)))
        return out
    spec.propose = record
    got, _ = _run(llm)
    assert got == plain_outputs
    assert not any(drafted for n, drafted in calls if n >= 3)
    assert any(drafted for n, drafted in calls if n < 3)
    assert any(n >= 3 for n, _ in calls)
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, disable_by_batch_size=1)
