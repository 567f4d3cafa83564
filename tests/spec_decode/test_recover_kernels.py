"""Triton RecoverSSM kernels: the CPU interpreter subset in a subprocess (TRITON_INTERPRET must
be set before triton is imported), GPU tests at the 48B model's sizes, and CPU dispatch/memory."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdaserve.kernels.kda import recover as rc

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def test_interpreter_suite():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "recover_checks.py")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cpu_dispatch_uses_twins():
    from kdaserve.kernels import reference as ref

    T, H, K = 3, 2, 4
    q, k, v, g = (torch.randn(T, H, K) for _ in range(4))
    g = -g.abs()
    beta = torch.rand(T, H)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    pool = torch.randn(2, H, K, K)
    out = torch.empty(T, H, K)
    pool0 = pool.clone()
    o, records = rc.kda_spec_verify(q, k, v, g, beta, cu, pool, torch.tensor([1]), out=out)
    assert o is out
    o_ref, s_ref = ref.kda_recurrent(q, k, v, g, beta, pool[1])
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    rc.kda_recover_commit(pool, torch.tensor([1]), records, cu, torch.tensor([3]))
    torch.testing.assert_close(pool[1], s_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[0], pool0[0])
    # gate activated by the callee: same result from raw gate + beta logits
    gate = rc.KDAGateParams(torch.randn(H), torch.randn(H * K))
    g_raw, b_logit = torch.randn(T, H, K), torch.randn(T, H)
    o2, rec2 = rc.kda_spec_verify(q, k, v, g_raw, b_logit, cu, pool0, torch.tensor([0]),
                                  gate=gate)
    g_act = ref.kda_gate(g_raw, gate.A_log, gate.dt_bias)
    o2_ref, _ = ref.kda_recurrent(q, k, v, g_act, torch.sigmoid(b_logit), pool0[0])
    torch.testing.assert_close(o2, o2_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rec2.g, g_act)
    with pytest.raises(ValueError, match="state_pool"):
        rc.kda_spec_verify(q, k, v, g, beta, cu, torch.zeros(2, H, K, 5), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"\[N, 1\+K\]"):
        rc.kda_spec_verify(q, k, v, g, beta, cu, pool, torch.tensor([1]), per_position=True)
    with pytest.raises(ValueError, match="beta"):
        rc.kda_spec_verify(q, k, v, g, beta[:, :1], cu, pool, torch.tensor([1]))


def test_state_memory_48b():
    """20 KDA layers, H=32, K=V=128, conv 12288 x 3 (bf16), K=8 drafts."""
    args = {"num_kda_layers": 20, "num_heads": 32, "head_k_dim": 128, "head_v_dim": 128,
            "conv_dim": 12288, "conv_kernel": 4, "num_speculative_tokens": 8}
    slot = 20 * (32 * 128 * 128 * 4 + 12288 * 3 * 2)
    pp = rc.spec_state_memory("per_position", **args)
    rs = rc.spec_state_memory("recover", **args)
    assert pp.total == 9 * slot
    assert rs.state_bytes == slot
    assert rs.record_bytes == 20 * 9 * (32 * 128 * 4 * 3 + 12288 * 2)
    assert rs.total * 6 < pp.total
    with pytest.raises(ValueError, match="mode"):
        rc.spec_state_memory("ring", **args)


def test_state_bytes_written_per_verify_step():
    """48B sizes, K=8: per_position writes 9 states (+1 copy when a draft is accepted);
    recover writes 9 records and one state."""
    args = {"num_kda_layers": 20, "num_heads": 32, "head_k_dim": 128, "head_v_dim": 128,
            "conv_dim": 12288, "conv_kernel": 4}
    slot = 20 * (32 * 128 * 128 * 4 + 12288 * 3 * 2)
    rec = 20 * (32 * 128 * 4 * 3 + 12288 * 2)
    assert rc.spec_state_bytes_written("per_position", **args, window=9, num_accepted=1) == 9 * slot
    assert rc.spec_state_bytes_written("per_position", **args, window=9, num_accepted=5) == 10 * slot
    assert rc.spec_state_bytes_written("recover", **args, window=9, num_accepted=5) == 9 * rec + slot
    assert rc.spec_state_bytes_written("recover", **args, window=3, num_accepted=1) == 3 * rec + slot
    with pytest.raises(ValueError, match="num_accepted"):
        rc.spec_state_bytes_written("recover", **args, window=3, num_accepted=4)
    with pytest.raises(ValueError, match="mode"):
        rc.spec_state_bytes_written("ring", **args, window=3, num_accepted=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", [None, (32, 4), (64, 2)])
def test_gpu_recover_48b_sizes(dtype, tile):
    from tests.spec_decode import recover_checks as chk

    cfg = rc.KDAVerifyConfig(*tile) if tile else None   # None: default_verify_config
    lens = [9] * 12 + [1, 5, 9, 3]
    chk.check_recover("cuda", H=32, K=128, D=12288, dtype=dtype, lens=lens, tol=1e-4,
                      config=cfg)
    chk.check_recover("cuda", H=32, K=128, D=12288, dtype=dtype, lens=lens, tol=1e-4,
                      gate_in_kernel="softplus", config=cfg)
    chk.check_per_position("cuda", H=32, K=128, D=12288, dtype=dtype, lens=[9, 4, 1, 9],
                           tol=1e-4, config=cfg)
    if tile is None:   # the verify conv into the layer's q | k | v planes, windows of 1-20
        chk.check_conv_verify("cuda", D=12288, dtype=dtype, lens=[9] * 15 + [20, 1],
                              planes=True, tol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_commit_under_cuda_graph():
    """verify + commit capture into one graph and replay with new accept counts."""
    from kdaserve.kernels import reference as ref
    from tests.spec_decode import recover_checks as chk

    H, K, D, lens = 32, 128, 12288, [9, 9, 9, 9]
    q, k, v, g, beta, _, cu = chk._inputs(lens, H, K, K, D, torch.bfloat16, "cuda", 0)
    pool = torch.randn(8, H, K, K, device="cuda") * 0.5
    slots = torch.tensor([1, 3, 5, 7], dtype=torch.int32, device="cuda")
    n = torch.tensor([9, 9, 9, 9], dtype=torch.int32, device="cuda")
    pool0 = pool.clone()

    def step():
        o, records = rc.kda_spec_verify(q, k, v, g, beta, cu, pool, slots)
        rc.kda_recover_commit(pool, slots, records, cu, n)
        return o

    step()                                     # compile outside capture
    pool.copy_(pool0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for counts in ([1, 2, 3, 4], [9, 0, 5, 1]):
        pool.copy_(pool0)
        n.copy_(torch.tensor(counts, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = pool0.cpu().clone()
        _, u_r, kh_r = ref.kda_spec_verify(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                                           cu.cpu(), want, slots.cpu())
        ref.kda_recover_commit(want, slots.cpu(), u_r, kh_r, g.cpu(), cu.cpu(),
                               torch.tensor(counts))
        chk._close(f"graph commit {counts}", pool.cpu(), want, 1e-4)
