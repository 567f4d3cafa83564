"""MLA decode's log-sum-exp and the merge of partial outputs by it (decode context
parallelism): the reference twins in-process, the Triton kernels through the CPU interpreter in
a subprocess, and on a GPU at the model's sizes."""

import pytest
import torch

import kernel_checks as kc

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_interpreter_mla_merge():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("mla_merge_checks.py", timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("dcp,interleave", [(2, 1), (2, 16), (4, 1), (3, 2)])
def test_reference_split_merge_equals_full(dcp, interleave):
    kc.check_mla_split_merge("cpu", torch.float64, [0, 1, 2, 37, 90, 129],
                             kc.dcp_owner(dcp, interleave), num_parts=dcp, triton=False,
                             seed=dcp + interleave)


def test_reference_lse_matches_logsumexp():
    from kdaserve.kernels import reference as ref

    kv, bt = kc.make_paged_kv("cpu", torch.float64, [5, 0], 4, 12)
    q = torch.randn(2, 3, 12, dtype=torch.float64)
    out, lse = ref.mla_decode(q, kv, bt, torch.tensor([5, 0]), 0.3, 8, return_lse=True)
    keys = ref.paged_gather(kv, bt[0], 5)
    torch.testing.assert_close(lse[0], torch.logsumexp(0.3 * q[0] @ keys.t(), -1).float())
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()
    assert torch.equal(ref.mla_decode(q, kv, bt, torch.tensor([5, 0]), 0.3, 8), out)


def test_reference_merge_single_partial_is_identity():
    from kdaserve.kernels import reference as ref

    o, l = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2)
    out, lse = ref.merge_attn_states(o, l)
    torch.testing.assert_close(out, o[0])
    torch.testing.assert_close(lse, l[0])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_lse_and_merge_gpu(dtype):
    kc.check_mla_decode_lse("cuda", dtype, [0, 1, 300, 4097], num_heads=32, page=64)
    kc.check_mla_decode_lse("cuda", dtype, [513, 2000], num_heads=20, num_kv_splits=7)
    kc.check_merge_attn_states("cuda", dtype, num_parts=8, rows=33, heads=32, dim=512)
    kc.check_mla_split_merge("cuda", dtype, [1, 2, 700, 3001], kc.dcp_owner(2, 1),
                             num_heads=32, kv_lora_rank=512, rope=64)
    kc.check_mla_split_merge("cuda", dtype, [5, 1000], kc.dcp_owner(8, 64), num_parts=8,
                             num_heads=32, page=64, kv_lora_rank=512, rope=64)
