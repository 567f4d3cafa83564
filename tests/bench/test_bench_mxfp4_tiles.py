# SPDX-License-Identifier: Apache-2.0
"""benchmarks/bench_mxfp4_tiles.py on the CPU (Triton interpreter, small shapes): every
candidate it times was first checked against the twin, the default tile of each class is among
the candidates, and the JSON names a best candidate per kernel. A test of the script, not of
the tiles' speed."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RUNNER = """
import runpy, sys
sys.path.insert(0, {kernels!r})
import kernel_checks
kernel_checks.patch_triton_interpreter()
sys.argv = ["bench_mxfp4_tiles.py"] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


def test_tile_sweep_checks_and_reports(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "tiles.json"
    code = RUNNER.format(kernels=os.path.join(ROOT, "tests", "kernels"),
                         script=os.path.join(ROOT, "benchmarks", "bench_mxfp4_tiles.py"))
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code, "--tokens", "1,3", "--experts",
                           "mxfp4,bf16", "--num-experts", "8", "--top-k", "2", "--latent", "64",
                           "--intermediate", "64", "--hidden", "48", "--quick", "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    points = json.loads(out.read_text())["points"]
    assert [(p["experts"], p["tokens"]) for p in points] == [
        ("mxfp4", 1), ("mxfp4", 3), ("bf16", 1), ("bf16", 3)]
    for p in points:
        for kind in ("gemm", "tail"):
            cands = p[kind]
            assert sum(c["default"] for c in cands) == 1, (kind, cands)
            assert all("us" in c and c["rel_err"] <= 1e-2 for c in cands), cands
            assert p[f"best_{kind}"] in cands
        assert "us" in p["unfused_tail"]
        assert p["gemm_floor_us"] > 0 and p["tail_floor_us"] > 0


def test_tuned_entries_take_each_points_fastest():
    """--write-configs: the GEMM winner per (format, N), the tail winner per N over the formats,
    completed with the fields the sweep does not vary, under the kernels' shape keys."""
    import argparse
    import importlib.util

    from kdaserve.kernels.moe.mxfp4_moe import (GEMM_FIELDS, TAIL_FIELDS, gemm_shape_key,
                                                tail_shape_key)

    spec = importlib.util.spec_from_file_location(
        "bench_mxfp4_tiles", os.path.join(ROOT, "benchmarks", "bench_mxfp4_tiles.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    a = argparse.Namespace(top_k=16, num_experts=256, latent=2048, intermediate=2048, hidden=2048)

    def point(fmt, N, gemm_us, tail_us, tail_n):
        return {"experts": fmt, "tokens": N,
                "best_gemm": dict(block_m=1, block_n=16, block_k=256, num_warps=4, num_stages=2,
                                  us=gemm_us),
                "best_tail": dict(tail_block_n=tail_n, tail_block_k=256, tail_num_warps=2,
                                  us=tail_us)}

    files = bench.tuned_entries(a, [point("mxfp4", 1, 20.0, 9.0, 32), point("bf16", 1, 40.0, 8.0, 8),
                                    point("mxfp4", 16, 30.0, 12.0, 64)], "NVIDIA H200", "/cfg")
    gemm = files["/cfg/mxfp4_moe_gemm_device_name=NVIDIA_H200.json"]
    tail = files["/cfg/latent_moe_tail_device_name=NVIDIA_H200.json"]
    assert set(gemm) == {gemm_shape_key(1, 256, 16, 2048, 2048, "mxfp4"),
                         gemm_shape_key(1, 256, 16, 2048, 2048, "bf16"),
                         gemm_shape_key(16, 256, 16, 2048, 2048, "mxfp4")}
    assert all(set(v) == set(GEMM_FIELDS) and v["group_m"] == 1 for v in gemm.values())
    t1 = tail[tail_shape_key(1, 16, 2048, 2048)]
    assert set(t1) == set(TAIL_FIELDS) and t1["tail_block_n"] == 8 and t1["tail_block_m"] == 1
    assert tail[tail_shape_key(16, 16, 2048, 2048)]["tail_block_m"] == 16


def test_the_stored_tiles_are_timed_beside_the_candidates():
    """--write-configs must not replace a config file's tiles with ones never timed against
    them: the sweep adds the stored tiles as a candidate unless one already has them."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_mxfp4_tiles as bench
    finally:
        sys.path.pop(0)
    base = dict(block_m=16, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=3,
                lut_decode=True)
    cands = [dict(block_m=1, block_n=16, block_k=256, num_warps=4, num_stages=2,
                  lut_decode=True)]
    assert bench.with_stored(cands, None, base) is None and len(cands) == 1
    stored = dict(block_m=1, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=2)
    got = bench.with_stored(cands, stored, base)
    assert got is cands[-1] and len(cands) == 2 and got == stored
    # already a candidate (fields it leaves out at base's values): that one, nothing added
    again = dict(block_m=1, block_n=16, block_k=256, group_m=1, num_warps=4, num_stages=2)
    assert bench.with_stored(cands, again, base) is cands[0] and len(cands) == 2
    # a bit-decode candidate is not the stored tiles (the kernels default to the table decode)
    bits = [dict(block_m=1, block_n=8, block_k=128, lut_decode=False)]
    assert bench.with_stored(bits, dict(block_m=1, block_n=8, block_k=128), base) is bits[1]
