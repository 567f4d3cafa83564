"""Async scheduling under speculative decoding (tiny presets, CPU fp32).

With device drafts (DSpark, MTP, the draft model) step N+1 is launched before step N's output is
processed: the scheduler gives placeholder drafts and worst-case positions, the runner reads
step N+1's windows and true positions on the device (worker/spec_async.py). Checked here:
greedy output with async on equals off (and the plain output) in every KDA state mode and batch
layout, with spec rows, prefills and non-speculating rows mixed, requests finishing mid-draft
(max_tokens, EOS / stop tokens, stop strings), preemption and abort mid-draft, nothing leaked
(the fixtures check every pool and the drafter); the overlap really happens (a step is launched
while the previous one is in flight, with positions fixed on the device); the drafters that
still need the host (ngram, the draft model's varlen catch-up) and penalties run one step
at a time with unchanged output; sampled output with probabilistic drafts under async follows
the target distribution (chi-square); the rejection sampler and the launch of an overlapped
step read nothing back from the device."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from kdaserve import SamplingParams
from kdaserve.spec_decode.rejection_sampler import RejectionSampler, SpecDecodeMetadata
from tests.engine.conftest import assert_drafter_free, llm_factory
from tests.spec_decode.test_dspark import dspark_dir  # noqa: F401
from tests.spec_decode.test_engine_spec import MODES, _prompts, draft_dirs  # noqa: F401
from tests.spec_decode.test_mtp import tiny_mtp_dir  # noqa: F401

K = 4


def _assert_drafter_free(llm) -> None:
    """No drafter state left: the DSpark drafter's blocks, the draft model's blocks and
    slots all back."""
    spec = llm.llm_engine.model_runner.spec
    if spec is None or not hasattr(spec.proposer, "device_proposals"):
        return
    from kdaserve.spec_decode.draft_model import DraftModelProposer

    if not isinstance(spec.proposer, DraftModelProposer):
        assert_drafter_free(llm)
        return
    eng, drafter = llm.llm_engine, spec.proposer
    if eng.scheduler.has_finished_requests():
        eng.step()
    assert not drafter.requests, "draft model state leaked"
    assert sorted(drafter._blocks.free) == list(range(drafter.caches.mla_kv[0].shape[0]))
    assert sorted(drafter._slots.free) == list(range(2 * drafter.max_num_seqs))


@pytest.fixture
def make_ds_llm(tiny_model_dir):
    yield from llm_factory(tiny_model_dir, after=_assert_drafter_free)


def _dspark(path, **kw) -> dict:
    return {"method": "dspark", "num_speculative_tokens": K, "model": path, **kw}


def _record(llm) -> tuple[list[str], list[bool]]:
    """('L' per launch, 'C' per collect of a step whose output is deferred; per launch,
    whether some row's positions were fixed on the device from the step in flight)."""
    runner, calls, fixed = llm.llm_engine.model_runner, [], []
    launch, collect, forward = runner.launch, runner.collect, runner._forward

    def rec_launch(so):
        step = launch(so)
        if step.output is None:
            calls.append("L")
        return step

    def rec_collect(step):
        if step.output is None:
            calls.append("C")
        return collect(step)

    def rec_forward(batch, *args):
        fixed.append(batch.carry is not None and batch.carry.corrected)
        return forward(batch, *args)
    runner.launch, runner.collect, runner._forward = rec_launch, rec_collect, rec_forward
    return calls, fixed


def _params() -> list[SamplingParams]:
    """Speculating greedy requests of several lengths (max_tokens 1 and 2 never draft), one
    ending on EOS / a stop token id mid-generation."""
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
            for m in (40, 1, 30, 2, 45, 23)]


def _drive(llm, prompts, params, stagger: int = 2, abort_at: dict | None = None):
    """Requests arrive every `stagger` steps (prefills share steps with spec rows); abort_at:
    step -> request ids aborted then. Returns {req_id: (token ids, finish reason, stop
    reason)} of the finished ones."""
    eng = llm.llm_engine
    pending = list(enumerate(prompts))
    outs, step = {}, 0
    while pending or eng.has_unfinished_requests():
        if pending and step % stagger == 0:
            i, p = pending.pop(0)
            eng.add_request(f"r{i}", p, params[i])
        if abort_at and step in abort_at:
            eng.abort_request(abort_at[step])
        for o in eng.step():
            if o.finished:
                c = o.outputs[0]
                outs[o.request_id] = (list(c.token_ids), c.finish_reason, c.stop_reason)
        step += 1
    return outs


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    from kdaserve import LLM

    llm = LLM(tiny_model_dir, max_model_len=512, num_gpu_blocks=256, max_num_batched_tokens=512)
    return _drive(llm, _prompts(), _params())


def _draft_model(path, **kw) -> dict:
    return {"method": "draft_model", "num_speculative_tokens": K, "model": path, **kw}


@pytest.mark.parametrize("method", ["dspark", "draft_model"])
@pytest.mark.parametrize("state_mode,layout", MODES)
def test_async_equals_sync(make_ds_llm, plain, dspark_dir, draft_dirs, method, state_mode,
                           layout):
    """The drafters that propose on the device: DSpark, and the draft model (a perturbed
    copy of the target: it accepts and rejects)."""
    make = _dspark if method == "dspark" else _draft_model
    spec = make(dspark_dir if method == "dspark" else draft_dirs, kda_state_mode=state_mode,
                batch_layout=layout)
    sync = _drive(make_ds_llm(speculative_config=spec, async_scheduling=False), _prompts(),
                  _params())
    llm = make_ds_llm(speculative_config=spec)
    assert llm.llm_engine.model_runner.spec.device_drafts
    calls, fixed = _record(llm)
    got = _drive(llm, _prompts(), _params())
    assert got == sync == plain
    assert "LL" in "".join(calls), "no speculative step was launched while another was in flight"
    assert any(fixed), "no step took its positions from the accepted counts of the step in flight"
    st = llm.llm_engine.spec_decoding_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st.as_dict()


def test_stops_found_late(make_ds_llm, plain, dspark_dir):
    """EOS / stop token ids inside an accepted window and max_tokens in mid-draft end the
    request when the step in flight is processed; its next step's work is dropped."""
    want = [plain[f"r{i}"][0] for i in range(len(_prompts()))]
    params = []
    for toks in want:
        stop = toks[len(toks) // 2] if len(toks) > 4 else 1
        params.append(SamplingParams(temperature=0.0, max_tokens=max(len(toks) - 1, 1),
                                     stop_token_ids=[stop]))
    sync = _drive(make_ds_llm(speculative_config=_dspark(dspark_dir), async_scheduling=False),
                  _prompts(), params)
    llm = make_ds_llm(speculative_config=_dspark(dspark_dir))
    calls, _ = _record(llm)
    got = _drive(llm, _prompts(), params)
    assert got == sync
    assert {r for _, r, _ in got.values()} == {"stop", "length"}
    assert "LL" in "".join(calls)


def test_stop_strings(make_ds_llm, dspark_dir):
    """A stop string (the front aborts the request in the core) with steps in flight."""
    llm = make_ds_llm(speculative_config=_dspark(dspark_dir))
    p = {"prompt_token_ids": _prompts()[0]}
    text = llm.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    assert len(text) >= 6
    stop = text[4:6]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                           stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[:text.index(stop)]


def test_preemption_and_abort_mid_draft(make_ds_llm, plain, dspark_dir):
    small = {"max_model_len": 128, "num_gpu_blocks": 12}
    llm = make_ds_llm(speculative_config=_dspark(dspark_dir), **small)
    sched = llm.llm_engine.scheduler
    in_flight, preempt = [], sched._preempt
    sched._preempt = lambda r: (in_flight.append(r.num_output_placeholders), preempt(r))[1]
    calls, _ = _record(llm)
    got = _drive(llm, _prompts(), _params(), stagger=1)
    assert got == plain
    assert sched.num_preemptions > 0 and any(in_flight), \
        f"no request was preempted with a speculative step in flight: {in_flight}"
    assert "LL" in "".join(calls)
    # aborts with a step in flight: everything comes back (the fixture checks every pool)
    llm = make_ds_llm(speculative_config=_dspark(dspark_dir))
    drafter = llm.llm_engine.model_runner.spec.proposer
    calls, _ = _record(llm)
    got = _drive(llm, _prompts(), _params(), abort_at={9: ["r0", "r2"], 14: ["r4"]})
    assert "r0" not in got and "r2" not in got and "r4" not in got
    assert got["r5"] == plain["r5"]
    assert "LL" in "".join(calls)
    llm.llm_engine.step()
    assert not drafter.requests and drafter.num_free_blocks == drafter.num_blocks


def test_synthetic_acceptance_with_overlap(make_ds_llm, dspark_dir):
    """The benchmark mode (synthetic acceptance) under async scheduling: every request drafts
    K tokens each step, steps overlap, and the mean acceptance length is the one set."""
    llm = make_ds_llm(speculative_config=_dspark(dspark_dir, rejection_sample_method="synthetic",
                                              synthetic_acceptance_length=2.5))
    calls, fixed = _record(llm)
    _drive(llm, _prompts(), [SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)]
           * len(_prompts()))
    st = llm.llm_engine.spec_decoding_stats
    assert st.synthetic and st.num_drafts > 50
    assert abs(st.mean_acceptance_length - 2.5) < 0.25, st.as_dict()
    assert "LL" in "".join(calls) and any(fixed)


def test_penalties_run_one_step_at_a_time(make_ds_llm, dspark_dir):
    """A request with a repetition penalty (never drafted) keeps every step one at a time
    while it runs; the output is unchanged."""
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                             repetition_penalty=1.3)]
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:2]]
    want = make_ds_llm(speculative_config=_dspark(dspark_dir), async_scheduling=False
                       ).generate(prompts, params, use_tqdm=False)
    llm = make_ds_llm(speculative_config=_dspark(dspark_dir))
    calls, _ = _record(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert "LL" not in "".join(calls)


@pytest.mark.parametrize("state_mode,layout", MODES)
def test_mtp_async_equals_sync(tiny_mtp_dir, state_mode, layout):
    """The MTP drafter proposes on the device too (its own preset: tiny-mtp)."""
    factory = llm_factory(tiny_mtp_dir, after=assert_drafter_free)
    make = next(factory)
    spec = {"method": "mtp", "num_speculative_tokens": K, "kda_state_mode": state_mode,
            "batch_layout": layout}
    plain = _drive(make(), _prompts(), _params())
    sync = _drive(make(speculative_config=spec, async_scheduling=False), _prompts(), _params())
    llm = make(speculative_config=spec)
    assert llm.llm_engine.model_runner.spec.device_drafts
    calls, fixed = _record(llm)
    assert _drive(llm, _prompts(), _params()) == sync == plain
    assert "LL" in "".join(calls) and any(fixed)
    st = llm.llm_engine.spec_decoding_stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0, st.as_dict()
    next(factory, None)


def test_mtp_device_proposals_equal_a_fresh_proposer(tiny_mtp_dir):
    """Device proposals (steps processed one at a time, so the drafts can be overridden: the
    known greedy continuation, some right, some wrong, accepted prefixes of every length) equal
    a fresh proposer's over the committed tokens and the target's from-scratch hidden states:
    the entries of every verified position and none of the rejected ones."""
    from kdaserve.spec_decode.mtp import MTPProposer
    from tests.spec_decode.test_engine_spec import _run
    from tests.spec_decode.test_mtp import _prenorm

    factory = llm_factory(tiny_mtp_dir, after=assert_drafter_free)
    make = next(factory)
    plain_out = _run(make())[0]
    llm = make(speculative_config={"method": "mtp", "num_speculative_tokens": K},
               enable_prefix_caching=False)
    eng, runner = llm.llm_engine, llm.llm_engine.model_runner
    eng.engine_core._can_overlap = lambda: False
    drafter, vocab = runner.spec.proposer, runner.args.vocab_size
    full = [p + o for p, o in zip(_prompts(), plain_out)]
    collect, checked = runner.collect, []

    def spy(step):
        out = collect(step)
        for rid, d in out.draft_token_ids.items():
            toks = runner.requests[rid].token_ids
            fresh = MTPProposer(drafter.model, K, 1, 512, 16, "cpu", torch.float32)
            fresh.add_hidden(rid, 0, _prenorm(runner.model, runner.args, toks[:-1]))
            assert d == fresh.propose([rid], [toks]).draft_token_ids[0], (rid, len(toks))
            checked.append(rid)
            i, n = int(rid[1:]), len(toks)
            right = full[i][n:n + len(d)]
            keep = (n + i) % (len(d) + 1)               # accept 0..len(d) of them
            out.draft_token_ids[rid] = right[:keep] + [(t + 1) % vocab
                                                       for t in right[keep:]]
        return out
    runner.collect = spy
    assert _run(llm)[0] == plain_out
    st = eng.spec_decoding_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st.as_dict()
    assert len(checked) > 20
    next(factory, None)


@pytest.mark.parametrize("method", ["ngram", "draft_model-varlen"])
def test_host_drafters_run_one_step_at_a_time(tiny_model_dir, method):
    """Drafters that propose from host token lists (ngram, the draft model with its varlen
    catch-up) cannot overlap: async on keeps them on the one-at-a-time path, with the output
    of async off."""
    model = tiny_model_dir
    spec = {"method": method.split("-")[0], "num_speculative_tokens": K}
    if method == "draft_model-varlen":
        spec.update(model=tiny_model_dir, draft_catchup="varlen")
    factory = llm_factory(model)
    make = next(factory)
    prompts = _prompts()[:4]
    params = _params()[:4]
    want = _drive(make(speculative_config=spec, async_scheduling=False), prompts, params)
    llm = make(speculative_config=spec)
    assert not llm.llm_engine.model_runner.spec.device_drafts
    calls, _ = _record(llm)
    assert _drive(llm, prompts, params) == want
    assert "LL" not in "".join(calls)
    next(factory, None)


def _chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution (series of the regularised upper
    incomplete gamma function; df small)."""
    a, t = df / 2.0, x / 2.0
    term = total = 1.0 / a
    n = 1
    while term > 1e-12 * total:
        term *= t / (a + n)
        total += term
        n += 1
    return 1.0 - math.exp(-t + a * math.log(t) - math.lgamma(a)) * total


def test_sampled_distribution_with_probabilistic_drafts(make_ds_llm, dspark_dir):
    """(t1, t2) of many seeded requests at temperature 1, top_k 3: t2 comes out of the
    rejection sampler over a window read from the step in flight (probabilistic drafts); the
    joint must follow the target: p(t1) p(t2 | t1) from the plain model's logprobs."""
    prompt = _prompts()[3]
    plain = make_ds_llm()
    lp1 = plain.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=1.0, max_tokens=1, logprobs=3),
                         use_tqdm=False)[0].outputs[0].logprobs[0]
    top1 = sorted(lp1, key=lambda t: -lp1[t].logprob)[:3]
    z1 = sum(math.exp(lp1[t].logprob) for t in top1)
    expect = {}
    for t1 in top1:
        lp2 = plain.generate([{"prompt_token_ids": prompt + [t1]}],
                             SamplingParams(temperature=1.0, max_tokens=1, logprobs=3),
                             use_tqdm=False)[0].outputs[0].logprobs[0]
        top2 = sorted(lp2, key=lambda t: -lp2[t].logprob)[:3]
        z2 = sum(math.exp(lp2[t].logprob) for t in top2)
        for t2 in top2:
            expect[(t1, t2)] = math.exp(lp1[t1].logprob) / z1 * math.exp(lp2[t2].logprob) / z2

    llm = make_ds_llm(speculative_config=_dspark(dspark_dir, num_speculative_tokens=2,
                                                 draft_sample_method="probabilistic"),
                      max_num_seqs=64)
    spec = llm.llm_engine.model_runner.spec
    assert spec.device_drafts
    calls, _ = _record(llm)
    # each verified draft (read from the window the step in flight made) and its q are the
    # ones the drafter proposed for that request
    proposed, checked = {}, []
    propose, draft_probs = spec.propose_device, spec._draft_probs

    def spy_propose(batch, *args):
        props, drafts = propose(batch, *args)
        for j, d in zip(props, drafts):
            rid = batch.req_ids[batch.sample_rows[j]]
            proposed[rid] = (d.clone(), spec.draft_probs[rid].clone())
        return props, drafts

    def spy_probs(states, drafts, logits, draft_ids):
        q = draft_probs(states, drafts, logits, draft_ids)
        start = 0
        for s, d in zip(states, drafts):
            if d:
                want_ids, want_q = proposed[s.req_id]
                assert torch.equal(draft_ids[start:start + len(d)], want_ids[:len(d)])
                assert torch.equal(q[start:start + len(d)], want_q[:len(d)])
                checked.append(s.req_id)
                start += len(d)
        return q
    spec.propose_device, spec._draft_probs = spy_propose, spy_probs
    n = 800
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True,
                             seed=1000 + i) for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    counts: dict = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(expect), f"tokens outside the top-k: {set(counts) - set(expect)}"
    stat = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in expect.items())
    p_value = _chi2_sf(stat, len(expect) - 1)
    assert p_value > 1e-3, (stat, p_value, counts, expect)
    assert "LL" in "".join(calls)
    assert len(checked) >= n, "t2 did not come out of a verification for every request"


def _count_host_reads(fn, *args, files: tuple[str, ...] = ()):
    """Run fn counting .item() / .tolist() / .cpu() / bool() / int() / float() on tensors,
    made from code in `files` (all code when empty)."""
    names = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    calls = []

    def wrap(name):
        orig = saved[name]

        def f(self, *a, **kw):
            caller = sys._getframe(1).f_code.co_filename
            if not files or caller.endswith(files):
                calls.append(f"{name} from {caller}:{sys._getframe(1).f_lineno}")
            return orig(self, *a, **kw)
        return f
    for n in names:
        setattr(torch.Tensor, n, wrap(n))
    try:
        out = fn(*args)
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
    return out, calls


def test_rejection_sampler_reads_nothing_back():
    """Standard rejection sampling over K+1 positions with top-k, top-p, min-p, seeded and
    unseeded rows, greedy rows, probabilistic drafts and logprobs: no host read."""
    from kdaserve.sample.metadata import SamplingMetadata

    g = torch.Generator().manual_seed(0)
    V, drafts = 32, [[3, 4, 5], [], [7, 8, 9], [1]]
    params = [SamplingParams(temperature=1.0, top_p=0.8, seed=5, logprobs=2),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, top_k=5, min_p=0.05),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=10)]
    gens = {0: torch.Generator().manual_seed(5)}
    spec = SpecDecodeMetadata.make(drafts)
    md = SamplingMetadata.build(params, gens, None, "cpu")
    logits = torch.randn(spec.num_rows, V, generator=g)
    q = torch.softmax(torch.randn(spec.draft_token_ids.shape[0], V, generator=g), -1)
    out, calls = _count_host_reads(RejectionSampler(), logits, spec, md, q)
    assert calls == []
    assert out.output_token_ids.shape == (4, 4)


_LAUNCH_FILES = ("spec_decode/rejection_sampler.py", "spec_decode/decoder.py",
                 "spec_decode/dspark.py", "spec_decode/draft_model.py", "worker/spec_async.py",
                 "spec_decode/draft_catchup.py", "spec_decode/draft_graphs.py",
                 "spec_decode/verify_graphs.py", "sample/sampler.py",
                 "spec_decode/sample_graphs.py", "spec_decode/dspark_window.py",
                 "spec_decode/dspark_graphs.py")
"""The code of an overlapped launch whose host reads are counted."""


def _overlapped_host_reads(runner) -> list[list[str]]:
    """Wrap runner.launch: per speculative step launched while another is in flight, the host
    reads its launch made from _LAUNCH_FILES (filled as the engine runs)."""
    launch, seen = runner.launch, []

    def counted(so):
        in_flight = any(s.num_pending for s in runner.requests.values())
        step, calls = _count_host_reads(launch, so, files=_LAUNCH_FILES)
        if in_flight and so.scheduled_spec_decode_tokens:
            seen.append(calls)
        return step
    runner.launch = counted
    return seen


@pytest.mark.parametrize("method", ["dspark", "draft_model"])
def test_overlapped_launch_reads_nothing_back(make_ds_llm, dspark_dir, draft_dirs, method):
    """While a speculative step is in flight the next one is launched: its sampling, commit,
    carry and proposal code makes no host read. (Not counted: the CPU reference backends,
    which read device values by design, and the metadata builder, which reads its own host
    `_cpu` tensors: on the CPU the two cannot be told apart.)"""
    spec = (_dspark(dspark_dir, draft_sample_method="probabilistic") if method == "dspark"
            else _draft_model(draft_dirs, draft_sample_method="probabilistic"))
    llm = make_ds_llm(speculative_config=spec)
    seen = _overlapped_host_reads(llm.llm_engine.model_runner)
    params = [SamplingParams(temperature=t, top_p=0.9, max_tokens=30, ignore_eos=True, seed=i)
              for i, t in enumerate((0.0, 1.0, 0.8))]
    llm.generate([{"prompt_token_ids": p} for p in _prompts()[:3]], params, use_tqdm=False)
    assert seen, "no speculative step was launched with another in flight"
    assert all(c == [] for c in seen), [c for c in seen if c][:1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_overlapped_graph_launch_reads_nothing_back(make_ds_llm, dspark_dir, monkeypatch,
                                                     temperature):
    """As above through the graph paths (run eagerly over their buffers): the verification
    graphs, the sampling graphs (greedy and top-p keys) and the DSpark window graphs read no
    device value on the host while a step is in flight (a read there would also break their
    capture)."""
    spec = _dspark(dspark_dir, draft_sample_method="probabilistic")
    llm = make_ds_llm(speculative_config=spec, max_num_seqs=8, async_scheduling=True)
    graphs = _bind_eager_graphs(llm, monkeypatch)
    seen = _overlapped_host_reads(llm.llm_engine.model_runner)
    sp = SamplingParams(temperature=temperature, top_p=0.9, max_tokens=24, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in _prompts()[:3]], sp, use_tqdm=False)
    stages = {b.stage for b in graphs.replays}
    assert {"dspark_window", "sample:greedy" if temperature == 0 else "sample:top_p"} <= stages
    assert seen and all(c == [] for c in seen), [c for c in seen if c][:1]


def test_graph_paths_with_device_drafts(make_ds_llm, plain, draft_dirs):
    """The CUDA-graph paths under async scheduling, run eagerly over the same buffers on the
    CPU: the target's verification windows (host fill, then the carry's ids and the fixed
    positions patched into the buffers; the commit from the device counts) and the draft
    model's one-token steps at device positions. Output: the plain greedy one."""
    from kdaserve.attention.forward_context import ForwardContext
    from kdaserve.spec_decode.draft_graphs import DraftDecodeGraphs
    from kdaserve.spec_decode.verify_graphs import SpecVerifyGraphs
    from kdaserve.worker.cuda_graphs import CudaGraphManager

    class EagerSpecGraphs(SpecVerifyGraphs):
        def capture(self):
            self.mds = {bs: self._metadata(bs) for bs in self.sizes}

        def _run(self, bs):
            md = self.mds[bs]
            return self._forward(bs, md), md.spec

        def _replay_commit(self, bs, step):
            self._commit_work(bs, step)

    class EagerDraftGraphs(DraftDecodeGraphs):
        def _run(self, size):
            return self.model.compute_logits(self.model(
                self.input_ids[:size], ForwardContext(self._metadata(size), self.caches)))

    llm = make_ds_llm(speculative_config=_draft_model(draft_dirs), max_num_seqs=8)
    runner = llm.llm_engine.model_runner
    runner.graphs = CudaGraphManager(8, pdl=False)   # the CPU run keeps no graphs
    vg = runner.spec.verify_graphs = EagerSpecGraphs(
        runner.graphs, runner.model, runner.caches, runner.spec.k, runner.num_slots,
        runner.block_size, runner.config.scheduler_config.max_model_len, runner.device)
    vg.capture()
    d = runner.spec.proposer
    d.graphs = EagerDraftGraphs(d.model, d.caches, 2 * d.max_num_seqs, d.block_size,
                                d.max_blocks_per_req, d.max_num_seqs, d.max_model_len, d.device)
    patched, run = [], vg.run

    def record(batch, states, patch=None):
        patched.append(patch is not None and batch.carry.corrected)
        return run(batch, states, patch)
    vg.run = record
    steps, step_device = [], d.graphs.step_device
    d.graphs.step_device = lambda *a: (steps.append(1), step_device(*a))[1]
    calls, _ = _record(llm)
    assert _drive(llm, _prompts(), _params()) == plain
    assert any(patched), "no verification graph took its positions from the step in flight"
    assert steps and "LL" in "".join(calls)


class _EagerGraphManager:
    """A CudaGraphManager whose "graphs" run their work again at each replay, over the same
    static buffers: the graph paths of the runner on the CPU."""

    def __init__(self, max_num_seqs: int) -> None:
        from kdaserve.worker.cuda_graphs import CudaGraphManager

        self._real = CudaGraphManager(max_num_seqs, pdl=False)
        self.sizes, self.max_size, self.pdl = self._real.sizes, self._real.max_size, False
        self.work, self.replays = {}, []

    def padded_size(self, n):
        return self._real.padded_size(n)

    def plan(self, batch):
        return self._real.plan(batch)

    def __contains__(self, batch):
        return batch in self.work

    def capture(self, batch, work, warmups: int = 2):
        self.work[batch] = work
        return work()

    def replay(self, batch):
        self.replays.append(batch)
        return self.work[batch]()


def _bind_eager_graphs(llm, monkeypatch) -> _EagerGraphManager:
    """The worker's graph set-up (decode graphs, then the spec decoder's) on the CPU."""
    from kdaserve.worker.cuda_graphs import DecodeGraphs

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a, **k: t)   # no CUDA host
    runner = llm.llm_engine.model_runner
    graphs = _EagerGraphManager(8)
    decode = DecodeGraphs(graphs, runner.model, runner.caches, runner.num_slots,
                          runner.block_size, runner.config.scheduler_config.max_model_len,
                          runner.device, hidden_outputs=runner.spec.hidden_outputs)
    decode.capture()
    runner.spec.capture_graphs(graphs, runner.model, runner.caches, runner.num_slots,
                               runner.block_size)
    runner.bind_graphs(graphs, decode)
    return graphs


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_graph_paths_hand_hidden_to_dspark(make_ds_llm, plain, dspark_dir, async_scheduling,
                                           monkeypatch):
    """Decode and verification steps replay their graphs with a DSpark drafter too (its
    context is the target's aux-layer outputs, a second graph output): under async
    scheduling the drafter reads the graph's buffer in the same launch, one step at a time
    it keeps a copy. Greedy output: the plain one."""
    from kdaserve.attention.forward_context import ExecMode

    def run(graph_paths: bool):
        llm = make_ds_llm(speculative_config=_dspark(dspark_dir), max_num_seqs=8,
                          async_scheduling=async_scheduling)
        graphs = _bind_eager_graphs(llm, monkeypatch) if graph_paths else None
        assert _drive(llm, _prompts(), _params()) == plain
        return graphs, llm.llm_engine.spec_decoding_stats.as_dict()

    graphs, stats = run(True)
    modes = {b.mode for b in graphs.replays}
    assert ExecMode.VERIFY_GRAPH in modes and ExecMode.DECODE_GRAPH in modes, modes
    # under async scheduling the drafter's block pass + Markov head replay their own graphs
    blocks = [b for b in graphs.replays if b.stage == "dspark_block"]
    assert bool(blocks) == async_scheduling, blocks
    # the drafter saw the same context as in the eager run: the same drafts were accepted
    assert stats["num_draft_tokens"] > 0 and stats == run(False)[1]


def test_dspark_block_graphs_probabilistic_drafts(make_ds_llm, plain, dspark_dir, monkeypatch):
    """Probabilistic drafts through the block graphs: padding rows beyond the sampling rows
    (3 requests pad to the capture size 4), the draft probabilities cloned out of the graph's
    output; greedy requests keep the plain output (their q is one-hot)."""
    llm = make_ds_llm(speculative_config=_dspark(dspark_dir,
                                                 draft_sample_method="probabilistic"),
                      max_num_seqs=8, async_scheduling=True)
    graphs = _bind_eager_graphs(llm, monkeypatch)
    assert _drive(llm, _prompts(), _params()) == plain
    sizes = {b.num_reqs for b in graphs.replays if b.stage == "dspark_block"}
    assert sizes, "the block graphs never replayed"
    assert llm.llm_engine.spec_decoding_stats.as_dict()["num_accepted_tokens"] > 0


def test_graph_paths_hand_hidden_to_mtp(tiny_mtp_dir, monkeypatch):
    """As above for the MTP drafter (the pre-final-norm hidden as the second output)."""
    from kdaserve.attention.forward_context import ExecMode

    factory = llm_factory(tiny_mtp_dir, after=assert_drafter_free)
    make = next(factory)
    plain = _drive(make(), _prompts(), _params())
    spec = {"method": "mtp", "num_speculative_tokens": K}
    eager = make(speculative_config=spec, max_num_seqs=8)
    assert _drive(eager, _prompts(), _params()) == plain
    llm = make(speculative_config=spec, max_num_seqs=8)
    graphs = _bind_eager_graphs(llm, monkeypatch)
    assert _drive(llm, _prompts(), _params()) == plain
    assert ExecMode.VERIFY_GRAPH in {b.mode for b in graphs.replays}
    stats = llm.llm_engine.spec_decoding_stats.as_dict()
    assert stats["num_accepted_tokens"] > 0
    assert stats == eager.llm_engine.spec_decoding_stats.as_dict()
    next(factory, None)


def _sample_stages(graphs) -> list[str]:
    return [b.stage for b in graphs.replays if b.stage.startswith("sample:")]


def test_sampling_graphs_greedy(make_ds_llm, plain, dspark_dir, monkeypatch):
    """Uniform verification steps sample through the sampling graphs (LM head + rejection
    sampler + the emitted counts into the commit graph's input), here run eagerly over their
    static buffers: greedy output is the plain one at several capture sizes (padding rows
    commit nothing)."""
    llm = make_ds_llm(speculative_config=_dspark(dspark_dir), max_num_seqs=8,
                      async_scheduling=True)
    graphs = _bind_eager_graphs(llm, monkeypatch)
    assert _drive(llm, _prompts(), _params()) == plain
    stages = _sample_stages(graphs)
    assert stages and set(stages) == {"sample:greedy"}, set(stages)
    sizes = {b.num_reqs for b in graphs.replays if b.stage.startswith("sample:")}
    assert len(sizes) > 1, sizes
    assert llm.llm_engine.spec_decoding_stats.as_dict()["num_accepted_tokens"] > 0


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("top_p,mixed", [(1.0, False), (0.8, False), (1.0, True), (0.8, True)])
def test_sampling_graphs_follow_the_eager_draws(make_ds_llm, dspark_dir, monkeypatch, top_p,
                                                mixed, async_scheduling):
    """Random rows, alone or next to greedy ones, with probabilistic drafts (standard
    acceptance, q through the static buffer): from one global seed the sampling graphs draw
    exactly what the eager sampler draws (the same operations in the same order), under the
    key of the parameters. Two requests: the batches are 2 or 1 rows, capture sizes
    themselves (a padding row draws in a graph, not eagerly, so the streams would part)."""
    spec = _dspark(dspark_dir, draft_sample_method="probabilistic")
    sp = [SamplingParams(temperature=0.0 if mixed and i % 2 else 0.9, top_p=top_p,
                         max_tokens=m, ignore_eos=True) for i, m in enumerate((16, 23))]
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:2]]

    def run(graphed: bool):
        llm = make_ds_llm(speculative_config=spec, max_num_seqs=8,
                          async_scheduling=async_scheduling)
        graphs = _bind_eager_graphs(llm, monkeypatch)
        if not graphed:
            llm.llm_engine.model_runner.spec.sample_graphs = None
        torch.manual_seed(1234)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        return outs, _sample_stages(graphs), llm.llm_engine.spec_decoding_stats.as_dict()

    got, stages, stats = run(True)
    want, none, want_stats = run(False)
    assert not none and stages
    alone = "sample:" + ("top_p" if top_p < 1.0 else "random")
    if mixed:   # once one kind of row has finished, the other samples under its own key
        key = "sample:mixed" + ("_top_p" if top_p < 1.0 else "")
        assert key in stages and set(stages) <= {key, alone, "sample:greedy"}, set(stages)
    else:
        assert set(stages) == {alone}
    assert got == want and stats == want_stats
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_sampling_graphs_stay_out_of_other_shapes(make_ds_llm, dspark_dir, monkeypatch):
    """Steps with top-k, seeds or logprobs sample eagerly (no key covers them)."""
    spec = _dspark(dspark_dir)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, logprobs=2, max_tokens=12, ignore_eos=True)]
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:4]]
    llm = make_ds_llm(speculative_config=spec, max_num_seqs=8, async_scheduling=True)
    graphs = _bind_eager_graphs(llm, monkeypatch)
    for sp in ([params[0], params[1]], [params[2]] * 2, [params[3]] * 2):
        llm.generate(prompts[:2], sp, use_tqdm=False)
    assert any(b.stage == "forward" and b.tokens_per_req == K + 1 for b in graphs.replays)
    assert _sample_stages(graphs) == []


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_dspark_window_graphs_match_the_block_path(make_ds_llm, dspark_dir, monkeypatch,
                                                   draft_sample_method):
    """After a verification graph the DSpark drafter's whole proposal (the window's context
    store, the block pass, the Markov head) replays one window graph: from one global seed
    the drafts, the accepted counts and the output equal those of the eager context store +
    block graph path, with requests finishing at different steps (padding rows store and
    write nothing: the later drafts would differ)."""
    spec = _dspark(dspark_dir, draft_sample_method=draft_sample_method)
    params = [SamplingParams(temperature=t, top_p=0.9, max_tokens=m, ignore_eos=True)
              for t, m in ((0.0, 20), (1.0, 9), (0.7, 14), (1.0, 20))]
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:4]]

    def run(windows: bool):
        llm = make_ds_llm(speculative_config=spec, max_num_seqs=8, async_scheduling=True)
        graphs = _bind_eager_graphs(llm, monkeypatch)
        if not windows:
            llm.llm_engine.model_runner.spec.proposer.windows = None
        torch.manual_seed(7)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stages = [b.stage for b in graphs.replays]
        return outs, stages, llm.llm_engine.spec_decoding_stats.as_dict()

    got, stages, stats = run(True)
    want, base_stages, want_stats = run(False)
    assert "dspark_window" in stages and "dspark_window" not in base_stages
    assert got == want and stats == want_stats
    assert [len(o) for o in got] == [20, 9, 14, 20]
    assert stats["num_accepted_tokens"] > 0
