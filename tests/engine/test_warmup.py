"""The start-up warm-up (worker/warmup.py warmup_steps) runs eager forwards over many step
compositions on the live caches, before any request holds a block or a slot. What it leaves
there must never reach a request: outputs after the warm-up equal those of an engine that never
ran it, greedy and seeded, with prefix-free chunked prefill and n > 1."""

from __future__ import annotations

import torch

from kdaserve import SamplingParams
from kdaserve.worker import warmup
from tests.engine.test_llm_engine import prompts


def _cache_checksum(caches) -> float:
    return float(sum(t.double().abs().sum() for t in caches.mla_kv + caches.kda_recurrent
                     + caches.kda_conv))


def test_warmup_leaves_no_trace(make_llm, monkeypatch):
    ps = prompts(6, seed=5, lo=10, hi=70)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2)] * 2
    ref = make_llm(max_num_seqs=8, max_num_batched_tokens=64)
    want = ref.generate(ps, params, use_tqdm=False)

    llm = make_llm(max_num_seqs=8, max_num_batched_tokens=64)
    runner = llm.llm_engine.model_runner
    calls = []
    forward = warmup._forward
    monkeypatch.setattr(warmup, "_forward",
                        lambda r, q, c, e=None: (calls.append((q, c, e)), forward(r, q, c, e)))
    before = _cache_checksum(runner.caches)
    with torch.inference_mode():
        warmup.warmup_steps(runner, llm.llm_engine.engine_config.scheduler_config)
    assert _cache_checksum(runner.caches) != before, "the warm-up wrote nothing"
    # decode-row counts 0..6 (max_num_seqs - 2) next to two prefills, 1..8 alone, 8 prefill
    # sizes across the budget, then budget-filling chunks next to 1, 2, 3 decode rows (16 and
    # 17 rows exceed max_num_seqs - 2)
    mixed = [sum(1 for x in q if x == 1) for q, _, _ in calls if q[-2:] == [100, 61]]
    alone = [len(q) for q, c, _ in calls if set(q) == {1} and c[0] > 0]
    # last, one fresh prefill at each end of every MoE alignment bucket
    aligned = warmup._alignment_token_counts(runner, 64)
    assert aligned and [q for q, _, _ in calls[len(calls) - len(aligned):]] == [[t] for t in aligned]
    calls = calls[:len(calls) - len(aligned)]
    # checkpoint exports on and off the 64-token grid, with and without an initial state
    assert [e for _, _, e in calls if e] == [[(0, 64), (0, 70), (1, 40)]]
    assert mixed == list(range(7)) and alone == list(range(1, 9)), (mixed, alone)
    short = [(q, c) for q, c, _ in calls if q[-1] in (2, 16) and c and c[-1] == 40]
    assert [q for q, _ in short] == [[1] * d + [q] for d in (0, 1, 3) for q in (2, 16)]
    assert all(min(c) > 0 for _, c in short)       # every row continues a state
    assert [q for q, _, _ in calls[-11:-3]] == [[max(1, 64 * j // 8 - 3)] for j in range(1, 9)]
    assert [q for q, _, _ in calls[-3:]] == [[1] * d + [64 - d] for d in (1, 2, 3)]
    got = llm.generate(ps, params, use_tqdm=False)
    for a, b in zip(want, got):
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.token_ids == cb.token_ids
            for da, db in zip(ca.logprobs or [], cb.logprobs or []):
                assert {t: round(v.logprob, 4) for t, v in da.items()} == \
                    {t: round(v.logprob, 4) for t, v in db.items()}


def test_alignment_token_counts_cover_every_bucket_end():
    """The warm-up's extra prefills hit the least and the largest token count of every
    BLOCK_T bucket of the MoE alignment kernel, for top_k and top_k + 1 entries a token."""
    from types import SimpleNamespace

    from torch import nn

    from kdaserve.kernels.moe.fused_moe import SMALL_ALIGN_ENTRIES, small_align_tiles
    from kdaserve.layers.moe import TopkRouter
    from kdaserve.worker.warmup import _alignment_token_counts

    router = TopkRouter.__new__(TopkRouter)
    nn.Module.__init__(router)
    router.top_k = 3
    runner = SimpleNamespace(model=nn.Sequential(router))
    got = _alignment_token_counts(runner, budget=256)
    for w in (3, 4):
        buckets = {}
        for t in range(1, min(256, SMALL_ALIGN_ENTRIES // w) + 1):
            buckets.setdefault(small_align_tiles(t * w)[0], []).append(t)
        for ts in buckets.values():
            assert ts[0] in got and ts[-1] in got, (w, ts)
    assert max(got) <= 256 and len(got) <= 4 * len(buckets)
