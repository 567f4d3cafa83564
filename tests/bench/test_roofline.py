"""`kdaserve bench roofline` on the CPU with the tiny model: the table and its floors."""

from __future__ import annotations

import json
import subprocess
import sys


def test_roofline_cpu(tmp_path):
    from kdaserve.models.make_model import make_model

    model = make_model(str(tmp_path / "tiny"), preset="tiny")
    out = tmp_path / "roof.json"
    proc = subprocess.run([sys.executable, "-m", "kdaserve.entrypoints.cli", "bench", "roofline",
                           model, "--batches", "1,3", "--contexts", "32,80", "--steps", "3",
                           "--load-format", "auto", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [(r["batch"], r["context"]) for r in res["rows"]] == [(1, 32), (3, 32), (1, 80), (3, 80)]
    for r in res["rows"]:
        assert r["step_ms"] > 0 and r["floor_ms"] > 0
        assert r["ratio"] == r["step_ms"] / r["floor_ms"]
        assert r["total_bytes"] == r["dense_bytes"] + r["expert_bytes"] + r["kv_bytes"] + \
            r["state_bytes"]
        assert 1 <= r["experts_touched_per_layer"] <= 8
    by = {(r["batch"], r["context"]): r for r in res["rows"]}
    assert by[(3, 80)]["kv_bytes"] == 3 * by[(1, 80)]["kv_bytes"]
    assert by[(1, 80)]["kv_bytes"] > by[(1, 32)]["kv_bytes"]


def test_experts_touched_needs_no_collective_on_a_tp_rank():
    """On one rank's model under TP (rank 0 alone, as bench_engine.py holds it) the
    vocabulary-parallel embedding is not called (its all-reduce would wait for the other
    ranks): ids fold into the rank's rows, the router sees those rows' embeddings."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from kdaserve.bench.roofline import experts_touched
    from kdaserve.distributed.comm import GroupComm
    from kdaserve.layers.parallel import VocabParallelEmbedding

    class NoCollective:
        rank, size = 0, 2

        def all_reduce(self, x):
            raise AssertionError("a collective on one rank alone")

    class Gate(nn.Module):   # expert = the largest embedding dimension
        def forward(self, x):
            return x.max(-1, keepdim=True)

    def model(embed):
        layer = SimpleNamespace(mlp=SimpleNamespace(gate=Gate()),
                                post_attention_layernorm=nn.Identity())
        return SimpleNamespace(model=SimpleNamespace(layers=[layer], embed_tokens=embed))

    full = torch.eye(8)[[0, 1, 2, 2, 3, 4, 5, 6]]           # token -> its expert, one-hot
    one = VocabParallelEmbedding(8, 8, GroupComm.single())
    one.weight.data = full
    rank0 = VocabParallelEmbedding(8, 8, NoCollective())     # rows 0..3 of the vocabulary
    rank0.weight.data = full[:4].clone()
    ids = torch.tensor([0, 1, 2, 3])
    assert experts_touched(model(one), ids) == 3             # tokens 2 and 3 share expert 2
    assert experts_touched(model(rank0), ids) == 3
    assert experts_touched(model(rank0), ids + 4) == 3       # folded onto rows 0..3
    assert experts_touched(model(rank0), torch.tensor([0, 4])) == 1
