"""Split-plane conv output and the router's shared-expert column, through the Triton
interpreter on the CPU (skipped where triton is not installed)."""

import pytest

import kernel_checks as kc


def test_interpreter_extras():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("interp_extras.py", timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
