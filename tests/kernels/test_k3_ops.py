"""The Kimi K3 kernels of the plain-torch pieces (AttnRes read, SiTU, sigmoid output gate, KDA
bounded gate + beta) against their twins: fp32 through the Triton interpreter on the CPU, bf16
on a GPU at kimi-k3-mini's and Kimi K3's sizes."""

import pytest
import torch

import kernel_checks as kc


def test_k3_ops_under_interpreter():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("k3_ops_checks.py", timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 3, 300])
@pytest.mark.parametrize("D", [2048, 7168])
@pytest.mark.parametrize("pdl", [False, True])
def test_attn_res_on_gpu(T, D, pdl):
    import k3_ops_checks as checks

    for seed, (n, w, delta, norm) in enumerate([(0, 0, False, True), (3, -1, True, True),
                                                (2, 2, True, True), (4, -1, True, False)]):
        checks.check_attn_res("cuda", torch.bfloat16, T=T, NB=5, D=D, num_blocks=n,
                              write_idx=w, delta=delta, out_norm=norm, pdl=pdl, seed=seed)


@pytest.mark.gpu
@needs_cuda
def test_attn_res_pdl_equals_plain_on_gpu():
    import k3_ops_checks as checks

    a = checks.check_attn_res("cuda", torch.bfloat16, T=2, NB=4, D=2048, num_blocks=3, seed=9)
    b = checks.check_attn_res("cuda", torch.bfloat16, T=2, NB=4, D=2048, num_blocks=3, seed=9,
                              pdl=True)
    assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 2, 77])
def test_elementwise_on_gpu(T):
    import k3_ops_checks as checks

    for inter in (1536, 6144):                     # mini's and K3's shared experts
        checks.check_situ("cuda", torch.bfloat16, T=T, inter=inter, seed=T)
    checks.check_situ("cuda", torch.bfloat16, T=T, inter=300, linear_beta=None, seed=T + 1)
    checks.check_sigmoid_gate("cuda", torch.bfloat16, T=T, n=16 * 128, seed=T)
    for H in (16, 96):
        checks.check_kda_gate("cuda", torch.bfloat16, T=T, H=H, K=128, seed=T + H)
