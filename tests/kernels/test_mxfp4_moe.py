"""The MXFP4 latent-MoE kernels (MXFP4 weights read directly, the top-k weighted sum fused into
the latent tail) against their twins: fp32 through the Triton interpreter on the CPU, bf16 on a
GPU."""

import pytest
import torch

import kernel_checks as kc


def test_mxfp4_moe_under_interpreter():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("mxfp4_moe_checks.py", timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mxfp4_moe_on_gpu():
    import mxfp4_moe_checks as checks

    checks.run_suite("cuda", torch.bfloat16)
    checks.check_partials("cuda", torch.bfloat16, N=64, E=64, k=8, D=512, inter=256)
    checks.check_tail("cuda", torch.bfloat16, N=64, k=8, L=512, H=1024)
