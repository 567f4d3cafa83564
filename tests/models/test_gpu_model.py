"""The bf16 GPU path (fla-core KDA, Triton MLA decode / MoE / conv) vs the fp32 CPU reference."""

from __future__ import annotations

import pytest
import torch

from kdaserve.models.registry import build_model
from tests.models.test_parity_hf import EXTRA, PROMPTS, Runner, pair, rel, run_chunked  # noqa: F401

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def separate_routing(model) -> None:
    """Make every MoE routing decision well separated: a random tiny model has near-ties (top-k
    margins of ~1e-4), and bf16 rounding flips such a tie, swapping an expert for one token and
    moving its logits by percents. That measures the model's conditioning, not the kernels: the
    fused MoE kernel is compared to its twin with random routing in tests/kernels."""
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.mul_(0.05)
                n = gate.e_score_correction_bias.numel()
                gate.e_score_correction_bias.copy_(torch.randperm(n).float() * 0.05)


def routing_margin(model, args, reqs) -> float:
    """Smallest gap between the k-th and (k+1)-th selection score over all tokens and layers."""
    margins = []

    def hook(mod, inp, out):
        sel = torch.nn.functional.linear(inp[0].float(), mod.weight).sigmoid() \
            + mod.e_score_correction_bias
        top = sel.topk(mod.top_k + 1, dim=-1).values
        margins.append((top[:, -2] - top[:, -1]).min().item())

    hooks = [l.mlp.gate.register_forward_hook(hook) for l in model.model.layers
             if hasattr(l.mlp, "gate")]
    Runner(model, args, len(PROMPTS)).step(reqs)
    for h in hooks:
        h.remove()
    return min(margins)


@pytest.fixture(scope="module")
def cpu_ref(pair):
    import copy

    _, ours, args = pair
    ref = copy.deepcopy(ours)
    separate_routing(ref)
    assert routing_margin(ref, args, [(i, p, 0) for i, p in enumerate(PROMPTS)]) > 0.01
    return ref


@pytest.fixture(scope="module")
def gpu_model(pair, cpu_ref):
    _, _, args = pair
    model = build_model(args, torch.bfloat16, "cuda")
    model.load_state_dict(cpu_ref.state_dict())
    model.process_weights_after_loading()
    return model, args


def test_bf16_gpu_one_batch_matches_cpu_reference(pair, cpu_ref, gpu_model):
    _, _, args = pair
    ours = cpu_ref
    model, _ = gpu_model
    reqs = [(i, p, 0) for i, p in enumerate(PROMPTS)]
    ref = Runner(ours, args, len(PROMPTS)).step(reqs)
    got = Runner(model, args, len(PROMPTS), torch.bfloat16, "cuda").step(reqs)
    for i in range(len(PROMPTS)):
        assert rel(got[i], ref[i]) <= 2e-2, i


def test_bf16_gpu_chunked_and_decode_matches_cpu_reference(pair, cpu_ref, gpu_model):
    _, _, args = pair
    ours = cpu_ref
    model, _ = gpu_model
    ref = run_chunked(Runner(ours, args, len(PROMPTS)), EXTRA)
    got = run_chunked(Runner(model, args, len(PROMPTS), torch.bfloat16, "cuda"), EXTRA)
    for i in range(len(PROMPTS)):
        assert rel(got[i], ref[i]) <= 2e-2, i


def test_gpu_engine_greedy_with_cuda_graphs(tmp_path):
    """The engine on CUDA generates the same greedy (and seeded) tokens with graphs on and off
    and with async scheduling on and off (async: decode inputs copied on the device from the
    previous step's sampled ids, graph staging in two pinned buffer sets), and with the decode
    kernels launched with PDL in the graphs."""
    from tests.engine.conftest import _write_tokenizer
    from tests.models.hf_tiny import make_hf_model

    from kdaserve import LLM, SamplingParams

    make_hf_model(seed=0).save_pretrained(str(tmp_path))
    _write_tokenizer(str(tmp_path))
    ps = [{"prompt_token_ids": p} for p in PROMPTS]
    sp = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)] * len(ps)
    outs = {}
    for eager, async_on, pdl in ((True, False, False), (False, False, False),
                                 (False, True, False), (True, True, False), (False, True, True)):
        llm = LLM(str(tmp_path), max_model_len=512, max_num_seqs=8, num_gpu_blocks=128,
                  enforce_eager=eager, dtype="float32", async_scheduling=async_on,
                  decode_gemv=pdl, pdl=pdl, fused_kda_decode=pdl)
        outs[eager, async_on, pdl] = [o.outputs[0].token_ids
                                 for o in llm.generate(ps, sp[:len(ps)], use_tqdm=False)]
        del llm
    assert len({str(v) for v in outs.values()}) == 1, outs


def run_one_request(runner, extra):
    """PROMPTS[0] alone: a prefill, then one-token decode steps (1-row steps: the GEMV's M=1
    and the fused MoE at N = 1)."""
    p = PROMPTS[0]
    got = [runner.step([(0, p, 0)])[0]]
    for j, t in enumerate(extra):
        got.append(runner.step([(0, [t], len(p) + j)])[0])
    return torch.cat(got)


@pytest.mark.parametrize("mla_absorb_gemv", [False, True])
def test_bf16_gpu_decode_kernels_match_cpu_reference(pair, cpu_ref, mla_absorb_gemv):
    """The decode-kernel backends (GEMV projections, the fused KDA decode; with
    mla_absorb_gemv MLA's W_UK / W_UV products as batched GEMVs) launched with PDL: 3-row
    decode steps (cuBLAS projections, PDL kernels, the fused KDA decode) and 1-row steps (the
    GEMV at M=1, the router reading its fp32 weight with bf16 x) against the fp32 reference."""
    from kdaserve.config import KernelConfig
    from kdaserve.layers.backends import select_backends

    _, _, args = pair
    kc = KernelConfig(decode_gemv=True, pdl=True, fused_kda_decode=True,
                      mla_absorb_gemv=mla_absorb_gemv)
    model = build_model(args, torch.bfloat16, "cuda", backends=select_backends(kc, "cuda"))
    model.load_state_dict(cpu_ref.state_dict())
    model.process_weights_after_loading()
    ref = run_chunked(Runner(cpu_ref, args, len(PROMPTS)), EXTRA)
    got = run_chunked(Runner(model, args, len(PROMPTS), torch.bfloat16, "cuda", pdl=True), EXTRA)
    for i in range(len(PROMPTS)):
        assert rel(got[i], ref[i]) <= 2e-2, i
    ref1 = run_one_request(Runner(cpu_ref, args, 1), EXTRA)
    got1 = run_one_request(Runner(model, args, 1, torch.bfloat16, "cuda", pdl=True), EXTRA)
    assert rel(got1, ref1) <= 2e-2


def test_gpu_spec_engine_greedy_with_cuda_graphs(tmp_path):
    """Draft-model speculation on CUDA (K=4): the tiny model drafting for itself (all drafts
    accepted) and a different tiny model (some rejected, so the draft catch-ups take 1..K+1
    tokens). With the draft's graphs (catch-up windows and one-token steps) and the target's
    spec-verify graphs (forward and commit) on, the greedy tokens equal the eager run's, the
    varlen catch-up's and plain decoding's."""
    from tests.engine.conftest import _write_tokenizer
    from tests.models.hf_tiny import make_hf_model

    from kdaserve import LLM, SamplingParams

    target, other = str(tmp_path / "target"), str(tmp_path / "other")
    make_hf_model(seed=0).save_pretrained(target)
    make_hf_model(seed=1).save_pretrained(other)
    _write_tokenizer(target)
    ps = [{"prompt_token_ids": p} for p in PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def spec(model, **kw):
        return {"method": "draft_model", "model": model, "num_speculative_tokens": 4, **kw}

    outs = {}
    for name, kw in (("plain", {}),
                     ("spec-eager", {"speculative_config": spec(target), "enforce_eager": True}),
                     ("spec-graphs", {"speculative_config": spec(target)}),
                     ("other-graphs", {"speculative_config": spec(other)}),
                     ("other-varlen", {"speculative_config": spec(other,
                                                                   draft_catchup="varlen")})):
        llm = LLM(target, max_model_len=512, max_num_seqs=8, num_gpu_blocks=128,
                  dtype="float32", **kw)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        runner = llm.llm_engine.model_runner
        if name.endswith("graphs"):
            prop = runner.spec.proposer
            assert prop.graphs is not None and prop.catchup.graphs
            assert prop.catchup.num_runs > 0
            assert runner.spec.verify_graphs is not None and runner.spec.verify_graphs.num_replays > 0
        if name == "other-graphs":
            assert runner.spec.stats.num_accepted_tokens < runner.spec.stats.num_draft_tokens
        del llm
    for name in outs:
        assert outs[name] == outs["plain"], name


@pytest.mark.parametrize("method", ["dspark", "dspark-probabilistic", "mtp"])
def test_gpu_hidden_drafters_replay_graphs(tmp_path, method):
    """The drafters that read the target's hidden states (a DSpark drafter on the tiny
    model, MTP on tiny-mtp), K=4, async scheduling: decode and verification steps replay
    their CUDA graphs (the hidden rows a second graph output), DSpark's block pass and Markov
    head theirs (with probabilistic drafts: the sampler's random draws inside the graph), and
    the greedy tokens equal plain decoding's and the eager run's."""
    from kdaserve import LLM, SamplingParams
    from kdaserve.models.make_model import make_dspark_model, make_model

    target = str(tmp_path / "target")
    make_model(target, "tiny-mtp" if method == "mtp" else "tiny")
    spec = {"method": method.split("-")[0], "num_speculative_tokens": 4}
    if method.startswith("dspark"):
        spec["model"] = make_dspark_model(target, str(tmp_path / "dspark"))
    if method == "dspark-probabilistic":
        spec["draft_sample_method"] = "probabilistic"
    ps = [{"prompt_token_ids": p} for p in PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for name, kw in (("plain", {}), ("eager", {"speculative_config": spec, "enforce_eager": True}),
                     ("graphs", {"speculative_config": spec})):
        llm = LLM(target, max_model_len=512, max_num_seqs=8, num_gpu_blocks=128,
                  dtype="float32", **kw)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        if name == "graphs":
            runner = llm.llm_engine.model_runner
            assert runner.spec.verify_graphs is not None
            assert runner.spec.verify_graphs.num_replays > 0
            assert runner.spec.stats.num_draft_tokens > 0
            if method != "mtp":   # the block pass + Markov head graphs were captured
                assert runner.spec.proposer.graphs is not None
                assert runner.spec.proposer.windows.num_replays > 0   # after verify graphs
            assert runner.spec.sample_graphs.num_replays > 0   # greedy: argmax acceptance
        del llm
    assert outs["eager"] == outs["plain"] and outs["graphs"] == outs["plain"]


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_gpu_sampling_graphs_random_rows(tmp_path, top_p):
    """Random rows through the spec-sampling graphs (DSpark, probabilistic drafts, standard
    acceptance; the draws inside the graph): every request gets its tokens, some drafts are
    accepted and some rejected, and the graphs replayed; greedy rows after them in the same
    engine still equal plain decoding (the graphs of another key left nothing behind)."""
    from kdaserve import LLM, SamplingParams
    from kdaserve.models.make_model import make_dspark_model, make_model

    target = str(tmp_path / "target")
    make_model(target, "tiny")
    spec = {"method": "dspark", "num_speculative_tokens": 4, "draft_sample_method":
            "probabilistic", "model": make_dspark_model(target, str(tmp_path / "dspark"))}
    ps = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(target, max_model_len=512, max_num_seqs=8, num_gpu_blocks=128, dtype="float32")
    plain = [o.outputs[0].token_ids for o in llm.generate(ps, greedy, use_tqdm=False)]
    del llm
    llm = LLM(target, max_model_len=512, max_num_seqs=8, num_gpu_blocks=128, dtype="float32",
              speculative_config=spec)
    sp = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=32, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
    runner = llm.llm_engine.model_runner
    assert all(len(o) == 32 for o in outs)
    vocab = runner.args.vocab_size
    assert all(0 <= t < vocab for o in outs for t in o)
    assert runner.spec.sample_graphs.num_replays > 0
    stats = runner.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    after = [o.outputs[0].token_ids for o in llm.generate(ps, greedy, use_tqdm=False)]
    assert after == plain


def test_gpu_verify_fold_greedy(tmp_path):
    """KernelConfig.mla_verify_fold: the verify graphs' MLA rows through the fold kernel (a
    DSpark drafter, K = 4: windows of 5 rows, 2 a program) give plain decoding's greedy
    tokens."""
    from kdaserve import LLM, SamplingParams
    from kdaserve.models.make_model import make_dspark_model, make_model

    target = make_model(str(tmp_path / "target"), "tiny")
    spec = {"method": "dspark", "num_speculative_tokens": 4,
            "model": make_dspark_model(target, str(tmp_path / "dspark"))}
    ps = [{"prompt_token_ids": p} for p in PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for name, kw in (("plain", {}), ("fold", {"speculative_config": spec,
                                              "mla_verify_fold": True})):
        llm = LLM(target, max_model_len=512, max_num_seqs=8, num_gpu_blocks=128,
                  dtype="float32", **kw)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        if name == "fold":
            runner = llm.llm_engine.model_runner
            assert runner.spec.verify_graphs.num_replays > 0
            assert all(m.verify_fold for m in runner.model.modules() if hasattr(m, "verify_fold"))
        del llm
    assert outs["fold"] == outs["plain"]
