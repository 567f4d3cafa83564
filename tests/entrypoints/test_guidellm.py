# SPDX-License-Identifier: Apache-2.0
"""guidellm 0.8.1 (benchmarks/run_guidellm.sh) against `kdaserve serve` on the CPU: 0 errors.

Needs guidellm in $GUIDELLM_VENV (default ~/.cache/kdaserve/guidellm-venv); running the script
once installs it there. Set KDASERVE_INSTALL_GUIDELLM=1 to let this test install it, reusing
this venv's torch + transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sysconfig

import pytest

from tests.entrypoints.conftest import REPO, RemoteServer

pytestmark = pytest.mark.slow

VENV = os.environ.get("GUIDELLM_VENV") or os.path.expanduser(
    "~/.cache/kdaserve/guidellm-venv")


def test_guidellm_concurrent_run_has_no_errors(tiny_model, tmp_path):
    installed = os.path.exists(os.path.join(VENV, "bin", "guidellm"))
    if not installed and os.environ.get("KDASERVE_INSTALL_GUIDELLM") != "1":
        pytest.skip(f"guidellm not installed in {VENV} (run benchmarks/run_guidellm.sh once "
                    "or set KDASERVE_INSTALL_GUIDELLM=1)")
    srv = RemoteServer([tiny_model, "--max-model-len", "1024", "--max-num-seqs", "16"])
    try:
        env = dict(os.environ, GUIDELLM_VENV=VENV,
                   GUIDELLM_REUSE_SITE=sysconfig.get_paths()["purelib"])
        r = subprocess.run(
            ["bash", os.path.join(REPO, "benchmarks", "run_guidellm.sh"), "--target", srv.url,
             "--streams", "4", "--requests", "24", "--prompt-tokens", "64",
             "--output-tokens", "16", "--out", str(tmp_path), "--tokenizer", tiny_model],
            capture_output=True, text=True, timeout=900, cwd=str(tmp_path), env=env)
    finally:
        srv.stop()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.load(open(tmp_path / "guidellm.json"))
    reqs = report["benchmarks"][0]["requests"]
    assert len(reqs["successful"]) == 24 and not reqs["errored"] and not reqs["incomplete"]
    # guidellm trusts the server's usage: every request reports exactly 16 output tokens
    assert all(req["output_tokens"] == 16 for req in reqs["successful"])
