"""The DSpark drafter (speculative method "dspark") on the tiny preset, CPU fp32, with a drafter
written by `make-model --draft-for tiny --draft-method dspark`.

Greedy output with DSpark drafts equals greedy output without speculation in both KDA state
modes and both batch layouts, with spec rows, plain decodes and prefills in the same steps,
with probabilistic drafts (the seed's config string as written), under preemption, across a
prefix-cache hit, with dummy weights, and with aborts mid-draft (the drafter's blocks come back); the speculators config is
read and validated (a bad field is a ValueError naming it); the weights are loaded from the
folder (embedding and LM head shared); the proposer's drafts depend only on the committed
tokens and the target's chosen-layer outputs of the accepted positions, its block pass is
non-causal, and the confidence head gives one probability per row. (The acceptance rate of a random drafter is whatever it is: not asserted.)"""

from __future__ import annotations

import json
import os

import pytest
import torch

from kdaserve import LLM, SamplingParams
from tests.engine.conftest import assert_drafter_free, llm_factory
from tests.spec_decode.test_engine_spec import MODES, _prompts, _run

K = 4


@pytest.fixture(scope="module")
def dspark_dir(tiny_model_dir, tmp_path_factory) -> str:
    from kdaserve.entrypoints.cli import main

    out = str(tmp_path_factory.mktemp("dspark"))
    assert main(["make-model", out, "--draft-for", tiny_model_dir,
                 "--draft-method", "dspark"]) in (0, None)
    return out


@pytest.fixture
def make_ds_llm(tiny_model_dir):
    """LLMs on tiny; afterwards every pool, the drafter's included, must be free."""
    yield from llm_factory(tiny_model_dir, after=assert_drafter_free)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    llm = LLM(tiny_model_dir, max_model_len=512, num_gpu_blocks=256, max_num_batched_tokens=512)
    return _run(llm)[0]


def _dspark(path, **kw) -> dict:
    return {"method": "dspark", "num_speculative_tokens": K, "model": path, **kw}


@pytest.mark.parametrize("state_mode,layout", MODES)
def test_dspark_greedy_equals_plain(make_ds_llm, plain, dspark_dir, state_mode, layout):
    llm = make_ds_llm(speculative_config=_dspark(dspark_dir, kda_state_mode=state_mode,
                                              batch_layout=layout))
    got, mixed = _run(llm)
    assert got == plain
    assert mixed, "no step mixed spec rows with other rows"
    st = llm.llm_engine.spec_decoding_stats
    assert st.num_drafts > 0 and st.num_draft_tokens > 0, st.as_dict()


def test_seed_config_probabilistic_accepted(make_ds_llm, plain, dspark_dir):
    """The seed's config as written: K = 8, probabilistic drafts, standard rejection."""
    llm = make_ds_llm(speculative_config={"method": "dspark", "num_speculative_tokens": 8,
                                       "draft_sample_method": "probabilistic",
                                       "rejection_sample_method": "standard",
                                       "model": dspark_dir})
    assert llm.llm_engine.model_runner.spec.probabilistic
    assert _run(llm)[0] == plain
    # sampled requests run too (no output asserted: the sampled continuation is random)
    sp = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=1)
    out = llm.generate([{"prompt_token_ids": p} for p in _prompts()[:3]], sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)


def test_dspark_preemption(make_ds_llm, plain, dspark_dir):
    llm = make_ds_llm(max_model_len=128, num_gpu_blocks=12, speculative_config=_dspark(dspark_dir))
    got, _ = _run(llm, stagger=1)
    assert got == plain
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_dspark_abort_mid_draft_frees_drafter(make_ds_llm, dspark_dir):
    llm = make_ds_llm(speculative_config=_dspark(dspark_dir), max_num_batched_tokens=32)
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
            assert drafter.requests
        engine.abort_request(ids)
        engine.step()
        assert not engine.has_unfinished_requests()
        assert not drafter.requests
        assert drafter.num_free_blocks == drafter.num_blocks


def test_dspark_dummy_load_format(make_ds_llm, dspark_dir):
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:3]]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = make_ds_llm(load_format="dummy").generate(prompts, sp, use_tqdm=False)
    llm = make_ds_llm(load_format="dummy", speculative_config=_dspark(dspark_dir))
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in base]
    assert llm.llm_engine.spec_decoding_stats.num_draft_tokens > 0


def test_dspark_folder_loaded_and_shared(make_ds_llm, dspark_dir):
    from safetensors import safe_open

    llm = make_ds_llm(speculative_config=_dspark(dspark_dir))
    runner = llm.llm_engine.model_runner
    model = runner.spec.proposer.model
    with open(os.path.join(dspark_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["speculators_model_type"] == "dspark"
    assert model.cfg.aux_hidden_state_layer_ids == tuple(cfg["aux_hidden_state_layer_ids"])
    assert runner.spec.aux_layers == model.cfg.aux_hidden_state_layer_ids
    with safe_open(os.path.join(dspark_dir, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == set(model.state_dict())
        for name in ("context_proj.weight", "layers.1.self_attn.kv_b_proj.weight",
                     "markov_proj.weight", "confidence_head.weight"):
            assert torch.equal(model.state_dict()[name].float(), f.get_tensor(name).float())
    target = runner.model
    assert model._shared == (target.model.embed_tokens, target.lm_head)
    own = {p.data_ptr() for p in model.parameters()}
    assert target.lm_head.weight.data_ptr() not in own
    assert target.model.embed_tokens.weight.data_ptr() not in own


@pytest.mark.parametrize("field,value,match", [
    ("aux_hidden_state_layer_ids", [0, 99], "aux_hidden_state_layer_ids"),
    ("aux_hidden_state_layer_ids", [], "aux_hidden_state_layer_ids"),
    ("mask_token_id", 10 ** 6, "mask_token_id"),
    ("target_hidden_size", 128, "target_hidden_size"),
    ("draft_vocab_size", 64, "draft_vocab_size"),
    ("markov_head_type", "rnn", "markov_head_type"),
    ("speculators_model_type", "eagle3", "speculators_model_type"),
])
def test_bad_dspark_config_names_the_field(tiny_model_dir, dspark_dir, tmp_path, field, value,
                                           match):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(dspark_dir, bad)
    with open(bad / "config.json") as f:
        cfg = json.load(f)
    cfg[field] = value
    with open(bad / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_dir, max_model_len=128, num_gpu_blocks=16,
            speculative_config=_dspark(str(bad)))


def test_dspark_needs_model(tiny_model_dir):
    with pytest.raises(ValueError, match="needs model"):
        LLM(tiny_model_dir, max_model_len=128, num_gpu_blocks=16,
            speculative_config={"method": "dspark", "num_speculative_tokens": K})


def test_make_model_draft_method_draft_model(tiny_model_dir, tmp_path):
    from kdaserve.entrypoints.cli import main

    out = str(tmp_path / "draft")
    assert main(["make-model", out, "--draft-for", tiny_model_dir,
                 "--draft-method", "draft_model"]) in (0, None)
    with open(os.path.join(out, "config.json")) as f:
        assert "speculators_model_type" not in json.load(f)
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


# ---- the proposer alone ----------------------------------------------------------------------

def _target_and_drafter(target_path, path):
    from kdaserve.config import LoadConfig
    from kdaserve.models.dspark import DSparkConfig, build_dspark, load_dspark_weights
    from tests.spec_decode.spec_harness import load_model

    model, args = load_model(target_path)
    drafter = build_dspark(model, DSparkConfig.from_folder(path, args), torch.float32, "cpu")
    load_dspark_weights(drafter, path, LoadConfig())
    return model, args, drafter


def _aux(model, args, layers, tokens):
    """The target's chosen-layer outputs [len, len(layers) * D] of `tokens` (one prefill)."""
    from kdaserve.attention.builder import build_metadata
    from kdaserve.attention.caches import allocate_caches
    from kdaserve.attention.forward_context import ForwardContext

    caches = allocate_caches(args, 16, 16, 1, torch.float32, "cpu")
    md = build_metadata([len(tokens)], [0], [list(range(16))], [0], 16, "cpu")
    with torch.inference_mode():
        return model(torch.tensor(tokens), ForwardContext(md, caches), return_prenorm=True,
                     aux_layers=layers)[1]


def test_aux_layers_are_the_layer_outputs(tiny_model_dir, dspark_dir):
    """aux_layers returns the residual stream after each chosen layer, in the asked order; the
    plain forward is unchanged."""
    model, args, drafter = _target_and_drafter(tiny_model_dir, dspark_dir)
    toks = list(range(3, 23))
    d = args.hidden_size
    last = args.num_hidden_layers - 1
    aux = _aux(model, args, (last, 0), toks)                                # [20, 2D]
    # the last layer's output is the pre-final-norm hidden
    from kdaserve.attention.builder import build_metadata
    from kdaserve.attention.caches import allocate_caches
    from kdaserve.attention.forward_context import ForwardContext

    caches = allocate_caches(args, 16, 16, 1, torch.float32, "cpu")
    md = build_metadata([len(toks)], [0], [list(range(16))], [0], 16, "cpu")
    with torch.inference_mode():
        hidden, prenorm = model(torch.tensor(toks), ForwardContext(md, caches),
                                return_prenorm=True)
    assert aux.shape == (20, 2 * d)
    torch.testing.assert_close(aux[:, :d], prenorm)
    assert torch.equal(aux[:, d:], _aux(model, args, (0,), toks))


def test_dspark_drafts_depend_only_on_accepted_positions(tiny_model_dir, dspark_dir):
    from kdaserve.spec_decode.dspark import DSparkProposer

    model, args, drafter = _target_and_drafter(tiny_model_dir, dspark_dir)
    layers = drafter.cfg.aux_hidden_state_layer_ids
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(3, args.vocab_size, (40,), generator=g).tolist()
    full = _aux(model, args, layers, seq)                                   # [40, 3D]
    inc = DSparkProposer(drafter, K, 2, 128, 16, "cpu", torch.float32)

    def fresh_drafts(length):
        fresh = DSparkProposer(drafter, K, 2, 128, 16, "cpu", torch.float32)
        fresh.add_hidden("r", 0, full[:length - 1])
        return fresh.propose(["r"], [seq[:length]]).draft_token_ids

    inc.add_hidden("r", 0, full[:9])
    length = 10
    assert inc.propose(["r"], [seq[:length]]).draft_token_ids == fresh_drafts(length)
    for accepted in (0, 4, 1, 2, 0, 3):
        window = full[length - 1:length + K].clone()
        window[accepted + 1:] = torch.randn(window[accepted + 1:].shape, generator=g)
        inc.add_hidden("r", length - 1, window)
        length += accepted + 1
        got = inc.propose(["r"], [seq[:length]]).draft_token_ids
        assert got == fresh_drafts(length), (length, accepted)
    inc.free("r")
    assert not inc.requests and inc.num_free_blocks == inc.num_blocks


def test_dspark_block_is_non_causal_and_batched(tiny_model_dir, dspark_dir):
    """Row 0's hidden depends on the later block rows (non-causal), and two requests proposed
    together draft what each drafts alone."""
    from kdaserve.spec_decode.dspark import DSparkProposer

    model, args, drafter = _target_and_drafter(tiny_model_dir, dspark_dir)
    layers = drafter.cfg.aux_hidden_state_layer_ids
    a, b = list(range(5, 25)), list(range(40, 71))  # vocab 128
    aux_a, aux_b = _aux(model, args, layers, a), _aux(model, args, layers, b)

    def drafts(pairs):
        p = DSparkProposer(drafter, K, 2, 128, 16, "cpu", torch.float32)
        for rid, toks, aux in pairs:
            p.add_hidden(rid, 0, aux[:len(toks) - 1])
        return p.propose([r for r, _, _ in pairs], [t for _, t, _ in pairs]).draft_token_ids
    assert drafts([("a", a, aux_a), ("b", b, aux_b)]) == \
        drafts([("a", a, aux_a)]) + drafts([("b", b, aux_b)])

    p = DSparkProposer(drafter, K, 1, 128, 16, "cpu", torch.float32)
    p.add_hidden("a", 0, aux_a[:len(a) - 1])
    seen = []
    block = drafter.forward_block

    def spy(ids, *rest):
        out = block(ids, *rest)
        seen.append(out[0].clone())
        ids2 = ids.clone()
        ids2[-1] = (ids2[-1] + 1) % args.vocab_size            # change the last block row only
        seen.append(block(ids2, *rest)[0].clone())
        return out
    drafter.forward_block = spy
    try:
        p.propose(["a"], [a])
    finally:
        del drafter.forward_block
    assert not torch.equal(seen[0], seen[1]), "row 0 does not see the later block rows"
    p.free("a")


@pytest.mark.parametrize("async_on", [False, True])
def test_dspark_with_prefix_cache_hit_equals_plain(make_ds_llm, dspark_dir, async_on):
    """A second turn starts from the first turn's cached prefix, whose positions the target
    does not recompute (the drafter's context there is zero aux); the output is the plain one.
    One step at a time the aux arrives through add_hidden; with async scheduling (device
    drafts) through propose_device."""
    from tests.spec_decode.test_mtp import _two_turns

    want = _two_turns(make_ds_llm())
    llm = make_ds_llm(speculative_config=_dspark(dspark_dir), async_scheduling=async_on)
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

        def spy(req_id, start, aux):
            if req_id not in drafter.requests and start > 0:
                late_starts.append(start)
            add(req_id, start, aux)
        drafter.add_hidden = spy
    assert _two_turns(llm) == want
    assert late_starts, "no prefix-cache hit"


def test_confidence_head(tiny_model_dir, dspark_dir):
    model, args, drafter = _target_and_drafter(tiny_model_dir, dspark_dir)
    assert drafter.cfg.enable_confidence_head
    with torch.inference_mode():
        e, bias = drafter.markov_bias(torch.tensor([3, 4, 5]))
        c = drafter.confidence(torch.randn(3, args.hidden_size), e)
    assert e.shape == (3, drafter.cfg.markov_rank) and bias.shape == (3, args.vocab_size)
    assert c.shape == (3,) and bool(((c > 0) & (c < 1)).all())


def test_block_drafts_markov_head_positions():
    """block_drafts' Markov head: each position's logits are its base row plus the bias of the
    token drawn before it (the request's last token first), greedy drafts are their argmax,
    and probabilistic q (one softmax over all K positions at the end) equals each position's
    own softmax(logits / T), one-hot at the draft on T = 0 rows."""
    from kdaserve.spec_decode.dspark_graphs import block_drafts

    n, k, V, r = 3, 4, 50, 6
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n * k, V, generator=g) * 3
    w1, w2 = torch.randn(V, r, generator=g), torch.randn(V, r, generator=g)

    class Drafter:
        def forward_block(self, ids, kv, slots, table, seq_lens, rows_per_seq):
            return torch.zeros(ids.shape[0], 2)

        def base_logits(self, hidden):
            return base.clone()

        def markov_bias(self, prev):
            return w1[prev], w1[prev] @ w2.T

    last = torch.tensor([7, 0, 49])
    temps = torch.tensor([0.0, 0.7, 1.3])
    rows = torch.zeros(n * k, dtype=torch.long)
    for method in ("greedy", "probabilistic"):
        torch.manual_seed(1)
        drafts, q = block_drafts(Drafter(), [], rows, rows, rows[:, None].int(), rows.int(),
                                 last, temps, method, k)
        assert drafts.shape == (n, k)
        prev = last
        for j in range(k):
            logits = base.view(n, k, V)[:, j] + w1[prev] @ w2.T                # [n, V]
            if method == "greedy":
                assert torch.equal(drafts[:, j], logits.argmax(-1))
            else:
                assert drafts[0, j] == logits[0].argmax()                       # T = 0 row
                assert torch.equal(q[0, j], torch.nn.functional.one_hot(drafts[0, j], V).float())
                for i in (1, 2):
                    want = torch.softmax(logits[i] / temps[i], -1)
                    assert torch.allclose(q[i, j], want, atol=1e-6), (i, j)
                    assert want[drafts[i, j]] > 0
            prev = drafts[:, j]
        assert (q is None) == (method == "greedy")


def test_drafter_layers_take_the_target_backends(tiny_model_dir, dspark_dir):
    """The drafter is built with the backends the worker chose for the target (its MLA fold
    switch here), not build_model's baseline set."""
    from kdaserve.engine.arg_utils import config_from_kwargs
    from kdaserve.layers.backends import LayerBackends
    from kdaserve.spec_decode.decoder import SpecDecoder

    model, args, _ = _target_and_drafter(tiny_model_dir, dspark_dir)
    config = config_from_kwargs({"model": tiny_model_dir, "device": "cpu",
                                 "speculative_config": _dspark(dspark_dir)})
    for fold in (True, False):
        spec = SpecDecoder(config, args, torch.device("cpu"), torch.float32, target_model=model,
                           backends=LayerBackends(mla_verify_fold=fold))
        attns = [layer.self_attn for layer in spec.proposer.model.layers]
        assert attns and all(a.verify_fold is fold for a in attns)
