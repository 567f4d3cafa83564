"""benchmarks/count_ops.py: per-piece op counts of one kimi-k3-tiny decode step on the CPU, the
reference pieces against the K3 kernels (through the Triton interpreter)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _run(args, interpret: bool):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT),
                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=600)


def test_count_ops_cli_reference(tmp_path):
    out = tmp_path / "ops.json"
    proc = _run([str(ROOT / "benchmarks" / "count_ops.py"), "--preset", "kimi-k3-tiny",
                 "--out", str(out)], interpret=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    rows = json.loads(out.read_text())["pieces"]
    assert rows["total"]["aten_ops"] == sum(r["aten_ops"] for k, r in rows.items()
                                            if k != "total")
    assert rows["total"]["triton_launches"] == 0          # the CPU reference set
    assert "MLP" in rows and rows["MLP"]["aten"]["tanh"] > 0   # SiTU's twin ops


def test_k3_kernels_logits_and_counts_under_interpreter():
    pytest.importorskip("triton")
    proc = _run([str(HERE / "count_ops_checks.py")], interpret=True)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), \
        proc.stdout[-3000:] + proc.stderr[-3000:]
