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
