# SPDX-License-Identifier: Apache-2.0
"""benchmarks/bench_prefix.py on the CPU with the tiny preset (scaled-down W3 and W2)."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_prefix.py")


def test_w3_and_w2_scaled_down(tmp_path):
    from kdaserve.models.make_model import make_model

    model = make_model(str(tmp_path / "tiny"), "tiny")
    out = tmp_path / "prefix.json"
    subprocess.run([sys.executable, SCRIPT, model, "--load-format", "auto", "--trials", "1",
                    "--w3-prefix", "640", "--w3-suffix", "40", "--w2-prefix", "1000",
                    "--w2-suffix", "100", "--w2-output", "4", "--max-num-batched-tokens", "1024",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["checkpoint_interval"] == 512 and res["gpu"] == "cpu"
    w3 = res["W3"]
    for mode in ("internal", "split"):
        trial = w3[mode]["trials"][0]
        assert trial["cold"]["num_cached_tokens"] == 0
        assert trial["hit"]["num_cached_tokens"] == 512          # the last boundary <= 640
        assert 0 < trial["hit"]["ttft_ms"] and 0 < trial["cold"]["ttft_ms"]
    # the cold 680-token prompt crosses the 512 checkpoint: one pass with internal export, two
    # when split ends a chunk there
    assert w3["internal"]["cold_forward_passes"] == [1]
    assert w3["split"]["cold_forward_passes"] == [2]
    w2 = res["W2"]
    assert w2["first"]["w2-0"]["num_cached_tokens"] == 0
    later = list(w2["later_c1"].values()) + list(w2["later_c2"].values())
    assert len(later) == 4 and all(r["num_cached_tokens"] == 512 for r in later)
    assert all(r["steps_until_all_first_tokens"] for r in later)
