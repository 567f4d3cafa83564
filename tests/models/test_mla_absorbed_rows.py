"""MLA's absorbed multi-token rows (speculative verification windows) against the expanded
prefill path on the same step: same logits (fp32, CPU)."""

from __future__ import annotations

import copy

import torch

from kdaserve.attention.builder import _mla_absorbed_rows, build_metadata
from kdaserve.attention.forward_context import ForwardContext
from tests.models.test_parity_hf import BLOCK, PROMPTS, Runner, pair, rel  # noqa: F401


def _step(model, caches, reqs, blocks, slots, absorbed_reqs, contiguous=True):
    md = build_metadata([len(t) for _, t, _ in reqs], [c for _, _, c in reqs],
                        [blocks[i] for i, _, _ in reqs], [slots[i] for i, _, _ in reqs],
                        BLOCK, "cpu")
    if absorbed_reqs:
        md.mla_absorbed = _mla_absorbed_rows(md, absorbed_reqs,
                                             md.query_start_loc_cpu.tolist(), contiguous)
    ids = torch.tensor([t for _, toks, _ in reqs for t in toks])
    with torch.no_grad():
        return model.compute_logits(model(ids, ForwardContext(md, caches)))


def test_absorbed_window_rows_match_the_expanded_path(pair):
    _, model, args = pair
    runner = Runner(model, args, len(PROMPTS))
    # prefill the first 40 / 30 / 60 tokens, then a step with a 1-token decode, a 5-token and a
    # 4-token window (the last two as absorbed rows, or through the expanded prefill path)
    runner.step([(0, PROMPTS[1][:40], 0), (1, PROMPTS[2][:30], 0), (2, PROMPTS[2][:60], 0)])
    step = [(0, PROMPTS[1][40:41], 40), (1, PROMPTS[2][30:35], 30), (2, PROMPTS[2][60:64], 60)]
    caches, caches_g = copy.deepcopy(runner.caches), copy.deepcopy(runner.caches)
    expanded = _step(model, runner.caches, step, runner.blocks, runner.slots, [])
    absorbed = _step(model, caches, step, runner.blocks, runner.slots, [1, 2])
    assert rel(absorbed, expanded) <= 1e-5
    # the windows first, in another order (gather layout: token indices instead of a slice)
    gathered = _step(model, caches_g, [step[1], step[0], step[2]], runner.blocks, runner.slots,
                     [0, 2], contiguous=False)
    assert rel(gathered[[5, 0, 1, 2, 3, 4, 6, 7, 8, 9]], expanded) <= 1e-5
    # the latents each path stored are the same
    for a, b in zip(caches_g.mla_kv, runner.caches.mla_kv):
        assert torch.allclose(a, b, atol=1e-6)


def test_uniform_windows_reach_the_fold(pair, monkeypatch):
    """Windows of one length carry rows_per_seq (mixed lengths: 1), and MLA layers with
    verify_fold (KernelConfig.mla_verify_fold) hand it with fold to the absorbed attention,
    where the CUDA kernel splits by sequence and folds 2 rows a program (the CPU reference
    ignores both): same logits."""
    from kdaserve.attention import mla_backend
    from kdaserve.layers.mla import MLAttention

    _, model, args = pair
    runner = Runner(model, args, len(PROMPTS))
    runner.step([(0, PROMPTS[1][:40], 0), (1, PROMPTS[2][:30], 0)])
    step = [(0, PROMPTS[1][40:44], 40), (1, PROMPTS[2][30:34], 30)]

    def rows_of(s):
        md = build_metadata([len(t) for _, t, _ in s], [c for _, _, c in s],
                            [runner.blocks[i] for i, _, _ in s], [runner.slots[i] for i, _, _ in s],
                            BLOCK, "cpu")
        return _mla_absorbed_rows(md, [0, 1], md.query_start_loc_cpu.tolist(), True)
    assert rows_of(step).rows_per_seq == 4
    assert rows_of([step[0], (1, PROMPTS[2][30:33], 30)]).rows_per_seq == 1

    seen, real = [], mla_backend.absorbed_attention

    def spy(*a, **kw):
        seen.append((kw.get("rows_per_seq"), kw.get("fold")))
        return real(*a, **kw)
    monkeypatch.setattr(mla_backend, "absorbed_attention", spy)
    for m in model.modules():
        if isinstance(m, MLAttention):
            monkeypatch.setattr(m, "verify_fold", True)
    caches = copy.deepcopy(runner.caches)
    expanded = _step(model, runner.caches, step, runner.blocks, runner.slots, [])
    assert not seen
    folded = _step(model, caches, step, runner.blocks, runner.slots, [0, 1])
    assert seen and set(seen) == {(4, True)}
    assert rel(folded, expanded) <= 1e-5
