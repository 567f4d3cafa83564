# SPDX-License-Identifier: Apache-2.0
"""The CUDA KDA path's short-row branch (fla fused recurrent, several tokens per row) against
the CPU reference, on the Triton interpreter. Needs fla-core (the GPU extra; CI leaves it out
because transformers' KimiLinear would then call fla's GPU kernels), so it runs where fla-core
is importable: the GPU machine, or locally with the wheel on PYTHONPATH."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core")
def test_short_rows_match_reference_on_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "kernels",
                                                     "short_rows_checks.py")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "short rows ok" in r.stdout
