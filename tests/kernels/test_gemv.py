"""Decode GEMV (kdaserve.kernels.linear.gemv) vs F.linear in fp32.

The fp32 interpreter subset runs in a subprocess with TRITON_INTERPRET=1 (it must be set before
triton is imported); input checks run without triton; GPU tests (marked gpu) use the
Kimi-Linear-48B shapes in bf16 and with the router's fp32 weight.
"""

import os

import pytest
import torch

import gemv_checks as gc
import kernel_checks as kc
from kdaserve.kernels.linear.gemv import GemvConfig, default_config, gemv

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16, F32 = torch.bfloat16, torch.float32


def test_gemv_interpreter():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("gemv_checks.py", timeout=120)
    assert proc.returncode == 0 and "passed" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("x_shape,w_shape,match", [
    ((5, 64), (32, 64), "M=5"),
    ((0, 64), (32, 64), "M=0"),
    ((2, 64), (32, 100), "x K=64 != weight K=100"),
    ((2, 64, 1), (32, 64), r"x must be \[M, K\]"),
])
def test_bad_shapes_name_the_value(x_shape, w_shape, match):
    with pytest.raises(ValueError, match=match):
        gemv(torch.randn(*x_shape), torch.randn(*w_shape))


def test_bad_layouts_and_outputs_name_the_value():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"weight must have a contiguous last dim.*\(1, 32\)"):
        gemv(x, torch.randn(64, 32).t())
    with pytest.raises(ValueError, match="x must have a contiguous last dim"):
        gemv(torch.randn(64, 2).t(), torch.randn(32, 64))
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match=r"out must be \[M=2, N=32\], got \(2, 31\)"):
        gemv(x, w, out=torch.empty(2, 31))
    with pytest.raises(ValueError, match="out must have a contiguous last dim"):
        gemv(x, w, out=torch.empty(32, 2).t())
    with pytest.raises(ValueError, match="out dtype torch.float32 != out_dtype torch.bfloat16"):
        gemv(x, w, out=torch.empty(2, 32), out_dtype=BF16)
    with pytest.raises(ValueError, match="weight dtype torch.int8"):
        gemv(x, w.to(torch.int8))
    with pytest.raises(ValueError, match="block_n must be a power of two.*got 24"):
        gemv(x, w, config=GemvConfig(24, 128, 4, 2))


def test_cpu_tensors_need_the_interpreter():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("interpreter mode accepts CPU tensors")
    with pytest.raises(ValueError, match="CUDA"):
        gemv(torch.randn(1, 64), torch.randn(32, 64))


@pytest.mark.parametrize("N,K,dtype", [(12288, 2304, BF16), (2304, 4096, BF16), (6720, 2304, BF16),
                                       (288, 2304, BF16), (256, 2304, F32), (22528, 2304, BF16),
                                       (37, 100, F32), (1, 8, F32)])
def test_default_config(N, K, dtype):
    cfg = default_config(1, N, K, dtype)
    programs = -(-N // cfg.block_n)
    assert programs >= 2 * 132 or cfg.block_n == 1, cfg          # >= 2 waves when N allows
    assert cfg.block_n == 64 or -(-N // (2 * cfg.block_n)) < 2 * 132, cfg   # none too small
    assert K % cfg.block_k == 0 or cfg.block_k >= K, cfg         # one masked step at most
    assert all(v & (v - 1) == 0 for v in (cfg.block_n, cfg.block_k, cfg.num_warps)), cfg
    assert 1 <= cfg.num_warps <= 8 and cfg.num_stages >= 1, cfg


def test_reference_twin():
    x, w = torch.randn(3, 40, dtype=BF16), torch.randn(24, 40)
    from kdaserve.kernels.linear.gemv import gemv_reference

    y = gemv_reference(x, w)
    assert y.dtype == BF16 and y.shape == (3, 24)
    torch.testing.assert_close(y, (x.double() @ w.double().T).to(BF16))


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

# Kimi-Linear-48B: q|k|v, o_proj, MLA q|kv_a, low-rank heads, layer 0's dense gate|up
MODEL_SHAPES = [(12288, 2304), (2304, 4096), (6720, 2304), (288, 2304), (22528, 2304)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K", MODEL_SHAPES)
@pytest.mark.parametrize("M", [1, 2, 4])
def test_gemv_model_shapes_gpu(N, K, M):
    gc.check_gemv("cuda", M, N, K, BF16, BF16, seed=M)
    gc.check_gemv("cuda", M, N, K, BF16, F32, seed=M + 10)               # bf16 x, fp32 weight


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M", [1, 2, 4])
def test_gemv_router_fp32_weight_gpu(M):
    gc.check_gemv("cuda", M, 256, 2304, BF16, F32, out_dtype=F32, seed=M)
    gc.check_gemv("cuda", M, 256, 2304, BF16, F32, strided_out=True, seed=M)


@pytest.mark.gpu
@gpu
def test_gemv_odd_shapes_and_configs_gpu():
    for M, N, K in ((1, 37, 100), (3, 300, 64), (4, 1000, 2304 + 8)):
        gc.check_gemv("cuda", M, N, K, F32, F32, strided_in=True, seed=N)
        gc.check_gemv("cuda", M, N, K, torch.float16, BF16, out_dtype=F32, bound=1e-2)
    for cfg in (GemvConfig(4, 1024, 4, 2), GemvConfig(64, 128, 8, 4), GemvConfig(8, 512, 2, 3)):
        gc.check_gemv("cuda", 4, 2304, 4096, BF16, BF16, config=cfg, strided_out=True)


@pytest.mark.gpu
@gpu
def test_gemv_graph_replay_is_deterministic_gpu():
    x = torch.randn(4, 2304, device="cuda", dtype=BF16)
    w = torch.randn(6720, 2304, device="cuda", dtype=BF16) * 0.02
    eager = gemv(x, w)
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x, w, out=out)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "graph replay differs from eager (nondeterministic?)"
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemv(x, w)), "replay did not read the new x"
