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
