"""Split-plane conv output and the router's shared-expert column, through the Triton
interpreter on the CPU (skipped where triton is not installed)."""

import pytest
import torch

import kernel_checks as kc


def test_interpreter_extras():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("interp_extras.py", timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_topk_num_warps_must_be_a_power_of_two():
    from kdaserve.kernels.moe.router import moe_topk_sigmoid

    with pytest.raises(ValueError, match="num_warps must be 1, 2, 4 or 8, got 3"):
        moe_topk_sigmoid(torch.randn(1, 8), None, 2, True, 1.0, num_warps=3)
