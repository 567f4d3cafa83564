"""The MTP drafter (speculative method "mtp") on the tiny-mtp preset, CPU fp32.

Greedy output with MTP drafts equals greedy output without speculation in both KDA state modes
and both batch layouts, with spec rows, plain decodes and prefills in the same steps, with
probabilistic drafts, under preemption, across a prefix-cache hit, with dummy weights, and with
aborts mid-draft (the drafter's blocks come back); the MTP weights are loaded from the
checkpoint (shared embedding and LM head); a target without MTP layers is refused; the
proposer's drafts depend only on the committed tokens and the target's hidden states of the
accepted positions, alone and as the engine hands them over (drafts forced to be partly
accepted). (The acceptance rate of a random MTP layer is whatever it is: not asserted.)"""

from __future__ import annotations

import random

import pytest
import torch

from kdaserve import LLM, SamplingParams
from tests.engine.conftest import assert_drafter_free, llm_factory
from tests.spec_decode.test_engine_spec import MODES, _prompts, _run

K = 3


@pytest.fixture(scope="module")
def tiny_mtp_dir(tmp_path_factory) -> str:
    from kdaserve.models.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("tiny_mtp")), preset="tiny-mtp")


@pytest.fixture
def make_mtp_llm(tiny_mtp_dir):
    """LLMs on tiny-mtp; afterwards every pool, the drafter's included, must be free."""
    yield from llm_factory(tiny_mtp_dir, after=assert_drafter_free)


@pytest.fixture(scope="module")
def plain(tiny_mtp_dir):
    llm = LLM(tiny_mtp_dir, max_model_len=512, num_gpu_blocks=256, max_num_batched_tokens=512)
    return _run(llm)[0]


def _mtp(**kw) -> dict:
    return {"method": "mtp", "num_speculative_tokens": K, **kw}


@pytest.mark.parametrize("state_mode,layout", MODES)
def test_mtp_greedy_equals_plain(make_mtp_llm, plain, state_mode, layout):
    llm = make_mtp_llm(speculative_config=_mtp(kda_state_mode=state_mode, batch_layout=layout))
    got, mixed = _run(llm)
    assert got == plain
    assert mixed, "no step mixed spec rows with other rows"
    st = llm.llm_engine.spec_decoding_stats
    assert st.num_drafts > 0 and st.num_draft_tokens > 0, st.as_dict()


def test_mtp_probabilistic_drafts_greedy_equals_plain(make_mtp_llm, plain):
    llm = make_mtp_llm(speculative_config=_mtp(draft_sample_method="probabilistic"))
    assert _run(llm)[0] == plain


def test_mtp_preemption(make_mtp_llm, plain):
    """Few KV blocks: requests are preempted and resumed mid-generation (the drafter's state is
    freed and rebuilt from the re-prefill)."""
    llm = make_mtp_llm(max_model_len=128, num_gpu_blocks=12, speculative_config=_mtp())
    got, _ = _run(llm, stagger=1)
    assert got == plain
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_mtp_abort_mid_draft_frees_drafter(make_mtp_llm):
    llm = make_mtp_llm(speculative_config=_mtp(), max_num_batched_tokens=32)
    engine = llm.llm_engine
    drafter = engine.model_runner.spec.proposer
    prompts = [[(7 * i + j) % 120 + 3 for j in range(20 + 9 * i)] for i in range(4)]
    for step_at in (1, 3, 6):
        ids = [f"a{step_at}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, SamplingParams(n=1 + len(rid) % 2, temperature=0.0,
                                                      max_tokens=30, ignore_eos=True))
        for _ in range(step_at):
            engine.step()
        if step_at == 6:
            assert drafter.requests             # the drafter holds state for running samples
        engine.abort_request(ids)
        engine.step()                           # the worker hears of the aborts
        assert not engine.has_unfinished_requests()
        assert not drafter.requests
        assert drafter.num_free_blocks == drafter.num_blocks


def _two_turns(llm) -> list[list[int]]:
    """A prompt, then a second turn continuing it (prompt + answer + 3 tokens)."""
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first = [(7 * j) % 120 + 3 for j in range(40)]
    a = llm.generate([{"prompt_token_ids": first}], sp, use_tqdm=False)[0].outputs[0].token_ids
    second = first + list(a) + [9, 10, 11]
    b = llm.generate([{"prompt_token_ids": second}], sp, use_tqdm=False)[0].outputs[0].token_ids
    return [list(a), list(b)]


@pytest.mark.parametrize("async_on", [False, True])
def test_mtp_with_prefix_cache_hit_equals_plain(make_mtp_llm, async_on):
    """The second turn starts from the first turn's cached prefix, which the target does not
    recompute (the drafter gets no hidden state there: zeros); the output is the plain one.
    One step at a time the hidden states arrive through add_hidden; with async scheduling
    (device drafts) through propose_device."""
    want = _two_turns(make_mtp_llm())
    llm = make_mtp_llm(speculative_config=_mtp(), async_scheduling=async_on)
    drafter = llm.llm_engine.model_runner.spec.proposer
    late_starts = []
    if async_on:
        propose = drafter.propose_device

        def spy_device(step):
            late_starts.extend(c for r, c in zip(step.req_ids, step.num_computed)
                               if r is not None and r not in drafter.requests and c > 0)
            return propose(step)
        drafter.propose_device = spy_device
    else:
        add = drafter.add_hidden

        def spy(req_id, start, hidden):
            if req_id not in drafter.requests and start > 0:
                late_starts.append(start)
            add(req_id, start, hidden)
        drafter.add_hidden = spy
    assert _two_turns(llm) == want
    assert late_starts, "no prefix-cache hit"


def test_mtp_weights_loaded_and_shared(make_mtp_llm, tiny_mtp_dir):
    from safetensors import safe_open

    llm = make_mtp_llm(speculative_config=_mtp())
    runner = llm.llm_engine.model_runner
    mtp = runner.spec.proposer.model
    with safe_open(f"{tiny_mtp_dir}/model.safetensors", framework="pt") as f:
        names = set(f.keys())
        for name, param in (("eh_proj.weight", mtp.layers[0].eh_proj.weight),
                            ("self_attn.o_proj.weight", mtp.layers[0].self_attn.o_proj.weight),
                            ("mlp.gate.weight", mtp.layers[0].mlp.gate.weight)):
            assert torch.equal(param.float(), f.get_tensor("model.layers.4." + name).float())
    assert "model.layers.4.enorm.weight" in names
    target = runner.model
    embed, head = mtp._shared
    assert embed is target.model.embed_tokens and head is target.lm_head
    own = {p.data_ptr() for p in mtp.parameters()}
    assert target.lm_head.weight.data_ptr() not in own
    assert target.model.embed_tokens.weight.data_ptr() not in own


def test_mtp_dummy_load_format(make_mtp_llm):
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:3]]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = make_mtp_llm(load_format="dummy").generate(prompts, sp, use_tqdm=False)
    llm = make_mtp_llm(load_format="dummy", speculative_config=_mtp())
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in base]
    assert llm.llm_engine.spec_decoding_stats.num_draft_tokens > 0


def test_tiny_mtp_preset(tiny_mtp_dir, tmp_path):
    """tiny plus one MTP layer at model.layers.4; every other tensor equals tiny's."""
    import json

    from safetensors.torch import load_file

    from kdaserve.config.model_args import KimiLinearArgs
    from kdaserve.models.loader import expected_tensors
    from kdaserve.models.make_model import make_model

    with open(f"{tiny_mtp_dir}/config.json") as f:
        args = KimiLinearArgs.from_hf_config(json.load(f))
    assert args.num_nextn_predict_layers == 1 and args.num_hidden_layers == 4
    w = load_file(f"{tiny_mtp_dir}/model.safetensors")
    assert set(w) == set(expected_tensors(args, include_mtp=True))
    tiny = load_file(f"{make_model(str(tmp_path / 'tiny'), preset='tiny')}/model.safetensors")
    assert set(w) - set(tiny) == {n for n in w if n.startswith("model.layers.4.")}
    assert all(torch.equal(tiny[n], w[n]) for n in tiny)


def test_target_without_mtp_layers_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        LLM(tiny_model_dir, max_model_len=128, num_gpu_blocks=16,
            speculative_config=_mtp())


def test_mtp_num_speculative_tokens_validated(tiny_mtp_dir):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny_mtp_dir, max_model_len=128, num_gpu_blocks=16,
            speculative_config={"method": "mtp", "num_speculative_tokens": 0})


# ---- the proposer alone ----------------------------------------------------------------------

def _target_and_drafter(path):
    from kdaserve.config import LoadConfig
    from kdaserve.models.mtp import build_mtp, load_mtp_weights
    from tests.spec_decode.spec_harness import load_model

    model, args = load_model(path)
    mtp = build_mtp(model, args, torch.float32, "cpu")
    load_mtp_weights(mtp, path, args, LoadConfig())
    return model, args, mtp


def _prenorm(model, args, tokens):
    """The target's pre-final-norm hidden [len, D] of `tokens` from scratch (one prefill)."""
    from kdaserve.attention.builder import build_metadata
    from kdaserve.attention.caches import allocate_caches
    from kdaserve.attention.forward_context import ForwardContext

    caches = allocate_caches(args, 16, 16, 1, torch.float32, "cpu")
    md = build_metadata([len(tokens)], [0], [list(range(16))], [0], 16, "cpu")
    with torch.inference_mode():
        return model(torch.tensor(tokens), ForwardContext(md, caches), return_prenorm=True)[1]


def test_mtp_drafts_depend_only_on_accepted_positions(tiny_mtp_dir):
    """A proposer fed step by step (window rows of rejected positions included, as the runner
    hands them over) drafts what a fresh proposer fed the whole committed sequence drafts."""
    from kdaserve.spec_decode.mtp import MTPProposer

    model, args, mtp = _target_and_drafter(tiny_mtp_dir)
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(3, 200, (40,), generator=g).tolist()
    full = _prenorm(model, args, seq)                                       # [40, D]
    inc = MTPProposer(mtp, K, 2, 128, 16, "cpu", torch.float32)

    def fresh_drafts(length):
        fresh = MTPProposer(mtp, K, 2, 128, 16, "cpu", torch.float32)
        fresh.add_hidden("r", 0, full[:length - 1])
        return fresh.propose(["r"], [seq[:length]]).draft_token_ids

    inc.add_hidden("r", 0, full[:9])                       # prompt of 9; token 9 sampled
    length = 10
    assert inc.propose(["r"], [seq[:length]]).draft_token_ids == fresh_drafts(length)
    for accepted in (0, 3, 1, 2, 0, 3):
        # the verify window at positions length-1 .. length-1+K: the rows past the accepted
        # ones are junk (the target saw rejected drafts there)
        window = full[length - 1:length + K].clone()
        window[accepted + 1:] = torch.randn(window[accepted + 1:].shape, generator=g)
        inc.add_hidden("r", length - 1, window)
        length += accepted + 1
        got = inc.propose(["r"], [seq[:length]]).draft_token_ids
        assert got == fresh_drafts(length), (length, accepted)
    inc.free("r")                                   # restart, as after a preemption
    assert not inc.requests and inc.num_free_blocks == inc.num_blocks
    inc.add_hidden("r", 0, full[:length - 1])
    assert inc.propose(["r"], [seq[:length]]).draft_token_ids == fresh_drafts(length)


def test_engine_hands_over_the_accepted_hidden_states(make_mtp_llm, plain):
    """In the engine, with drafts overridden by the known greedy continuation (some right, some
    wrong: accepted prefixes of every length), each MTP proposal equals a fresh proposer's over
    the committed tokens and the target's from-scratch hidden states: the runner hands over
    every computed position and the rejected window rows are dropped. (One step at a time:
    the host path; test_spec_async checks the device path the same way.)"""
    from kdaserve.spec_decode.mtp import MTPProposer

    llm = make_mtp_llm(speculative_config=_mtp(), enable_prefix_caching=False,
                       async_scheduling=False)
    runner = llm.llm_engine.model_runner
    drafter = runner.spec.proposer
    prompts = _prompts()
    full = [p + o for p, o in zip(prompts, plain)]
    propose, checked = drafter.propose, []
    vocab = runner.args.vocab_size

    def spy(req_ids, token_ids, temperatures=None, max_drafts=None):
        out = propose(req_ids, token_ids, temperatures, max_drafts)
        for j, (rid, toks) in enumerate(zip(req_ids, token_ids)):
            fresh = MTPProposer(drafter.model, K, 1, 512, 16, "cpu", torch.float32)
            fresh.add_hidden(rid, 0, _prenorm(runner.model, runner.args, toks[:-1]))
            want = fresh.propose([rid], [toks], None, [max_drafts[j]]).draft_token_ids[0]
            assert out.draft_token_ids[j] == want, (rid, len(toks))
            checked.append(rid)
            i, n = int(rid[1:]), len(toks)
            d = out.draft_token_ids[j]
            right = full[i][n:n + len(d)]
            keep = (n + i) % (len(d) + 1)               # accept 0..len(d) of them
            out.draft_token_ids[j] = right[:keep] + [(t + 1) % vocab for t in right[keep:]]
        return out
    drafter.propose = spy
    got, _ = _run(llm)
    assert got == plain
    st = llm.llm_engine.spec_decoding_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st.as_dict()
    assert len(checked) > 20


def test_mtp_with_offloaded_prefixes_equals_plain(make_mtp_llm):
    """Device drafts (async scheduling) over prefixes the small device cache evicted to the
    offload tier and loads back: the output of the run without prefix caching."""
    rng = random.Random(11)
    bases = [[rng.randrange(3, 128) for _ in range(140)] for _ in range(3)]
    prompts = [rng.choice(bases) + [rng.randrange(3, 128) for _ in range(rng.randint(1, 9))]
               for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    small = dict(block_size=16, num_gpu_blocks=30, kda_checkpoint_interval=64,
                 num_kda_checkpoint_slots=4, max_model_len=256, max_num_seqs=4)

    def run(llm):
        out = []
        for i in range(0, len(prompts), 4):
            batch = llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + 4]], params,
                                 use_tqdm=False)
            out += [list(o.outputs[0].token_ids) for o in batch]
        return out

    want = run(make_mtp_llm(enable_prefix_caching=False, **small))
    llm = make_mtp_llm(speculative_config=_mtp(), kv_offload_size=0.01, **small)
    assert llm.llm_engine.model_runner.spec.device_drafts
    assert run(llm) == want
    assert llm.llm_engine.get_stats().offload_host_hit_tokens > 0
