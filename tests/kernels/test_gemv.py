"""Decode GEMV (kdaserve.kernels.linear.gemv) vs F.linear in fp32.

The fp32 interpreter subset runs in a subprocess with TRITON_INTERPRET=1 (it must be set before
triton is imported); input checks run without triton; GPU tests (marked gpu) use the
Kimi-Linear-48B shapes in bf16 and with the router's fp32 weight. The pdl (programmatic
dependent launch) path: bit-equality with pdl=False under the interpreter and on the GPU (eager
and in a captured CUDA graph), and its instruction order in sm_90 PTX compiled on the CPU.
"""

import os
from dataclasses import replace

import pytest
import torch

import gemv_checks as gc
import kernel_checks as kc
from kdaserve.kernels.linear.gemv import (GemvConfig, check_config, default_config, gemv,
                                          gemv_batched, guess_config, tuned_configs)

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
    with pytest.raises(ValueError, match=r"prefetch must be one of \(0, 1, 2\), got 3"):
        gemv(x, w, config=GemvConfig(16, 128, 4, 2, prefetch=3), pdl=True)


def test_swiglu_bad_shapes_name_the_value():
    with pytest.raises(ValueError, match=r"swiglu: x must be \[M, 2K\].*\(2, 64\)"):
        gemv(torch.randn(2, 64), torch.randn(32, 64), swiglu=True)


def test_batched_bad_shapes_name_the_value():
    with pytest.raises(ValueError, match="same B"):
        gemv_batched(torch.randn(3, 1, 64), torch.randn(2, 8, 64))
    with pytest.raises(ValueError, match=r"x must be \[B, M, K\]"):
        gemv_batched(torch.randn(1, 64), torch.randn(1, 8, 64))
    with pytest.raises(ValueError, match="M=5"):
        gemv_batched(torch.randn(2, 5, 64), torch.randn(2, 8, 64))
    with pytest.raises(ValueError, match=r"out must be \[B=2, M=1, N=8\]"):
        gemv_batched(torch.randn(2, 1, 64), torch.randn(2, 8, 64), out=torch.empty(3, 1, 8))
    with pytest.raises(ValueError, match="x K=64 != weight K=32"):
        gemv_batched(torch.randn(2, 1, 64), torch.randn(2, 8, 32))


def test_cpu_tensors_need_the_interpreter():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("interpreter mode accepts CPU tensors")
    with pytest.raises(ValueError, match="CUDA"):
        gemv(torch.randn(1, 64), torch.randn(32, 64))


@pytest.mark.parametrize("N,K,dtype", [(12288, 2304, BF16), (2304, 4096, BF16), (6720, 2304, BF16),
                                       (288, 2304, BF16), (256, 2304, F32), (22528, 2304, BF16),
                                       (37, 100, F32), (1, 8, F32)])
def test_guess_config(N, K, dtype):
    cfg = guess_config(N, K, dtype)
    programs = -(-N // cfg.block_n)
    assert programs >= 2 * 132 or cfg.block_n == 1, cfg          # >= 2 waves when N allows
    assert cfg.block_n == 64 or -(-N // (2 * cfg.block_n)) < 2 * 132, cfg   # none too small
    assert K % cfg.block_k == 0 or cfg.block_k >= K, cfg         # one masked step at most
    assert all(v & (v - 1) == 0 for v in (cfg.block_n, cfg.block_k, cfg.num_warps)), cfg
    assert 1 <= cfg.num_warps <= 8 and cfg.num_stages >= 1, cfg


def test_tuned_configs_are_valid_and_used():
    """Every measured config passes check_config, fits the 256-elements-per-thread tile rule of
    the sweeps, and is what default_config returns at 132 SMs (no device given)."""
    tuned = tuned_configs(None, 132)
    assert tuned
    for key, cfg in tuned.items():
        dims = dict(kv.split("=") for kv in key.split(","))       # "M=1,N=...,dtype=bfloat16"
        M, N, K = int(dims["M"]), int(dims["N"]), int(dims["K"])
        dtype = getattr(torch, dims["dtype"])
        check_config(cfg)
        assert cfg.block_n * cfg.block_k // (32 * cfg.num_warps) <= 256, cfg
        assert default_config(M, N, K, dtype) == cfg
        assert default_config(M + 1, N, K, dtype) == guess_config(N, K, dtype)


def _ptxas():
    triton = pytest.importorskip("triton")
    from pathlib import Path

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_pdl_sm90_ptx_order(prefetch):
    """Compiled for sm_90 (no GPU needed): exactly the prefetched weight tiles' 16-byte loads
    come before griddepcontrol.wait, launch_dependents right after it, x loads and the store
    after; the kernel carries the launch_pdl flag. The o_proj default tile: 8 x 512 bf16, 8
    warps = 2 vector loads a tile per thread."""
    _ptxas()
    from kdaserve.kernels.linear.triton_gemv import gemv_kernel

    types = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", N="i32", K="i32",
                 stride_xm="i32", stride_wn="i32", stride_om="i32", stride_xb="i32",
                 stride_wb="i32", stride_ob="i32")
    consts = dict(M=1, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, EVEN_K=True, PREFETCH=prefetch,
                  USE_PDL=True)
    k = gc.sm90_compile(gemv_kernel, types, consts, num_warps=8, launch_pdl=True)
    assert k.metadata.launch_pdl
    before, after = gc.split_at_wait(k.asm["ptx"])
    tile_loads = 8 * 512 * 2 // (8 * 32 * 16)
    assert len(before) == prefetch * tile_loads, before
    assert all(op.startswith("ld.global.v4") for op in before), before
    assert after[0].startswith("griddepcontrol.launch_dependents"), after[:2]
    assert any(op.startswith("st.global") for op in after), after


def test_no_pdl_ptx_has_no_griddepcontrol():
    _ptxas()
    from kdaserve.kernels.linear.triton_gemv import gemv_kernel

    types = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", N="i32", K="i32",
                 stride_xm="i32", stride_wn="i32", stride_om="i32", stride_xb="i32",
                 stride_wb="i32", stride_ob="i32")
    consts = dict(M=2, BLOCK_M=2, BLOCK_N=32, BLOCK_K=256, EVEN_K=True)
    k = gc.sm90_compile(gemv_kernel, types, consts, num_warps=8, launch_pdl=False)
    assert not k.metadata.launch_pdl
    assert not any("griddepcontrol" in op for op in gc.memory_ops(k.asm["ptx"]))


def test_reference_twin():
    x, w = torch.randn(3, 40, dtype=BF16), torch.randn(24, 40)
    from kdaserve.kernels.linear.gemv import gemv_reference

    y = gemv_reference(x, w)
    assert y.dtype == BF16 and y.shape == (3, 24)
    torch.testing.assert_close(y, (x.double() @ w.double().T).to(BF16))
    gu = torch.randn(3, 80, dtype=BF16)                                  # [M, 2K] gate | up
    act = (torch.nn.functional.silu(gu[:, :40].float()) * gu[:, 40:].float()).to(BF16)
    torch.testing.assert_close(gemv_reference(gu, w, swiglu=True), gemv_reference(act, w))


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

# Kimi-Linear-48B: q|k|v, o_proj, MLA q|kv_a, low-rank heads, a wide N, layer 0's dense gate|up
MODEL_SHAPES = [(12288, 2304), (2304, 4096), (6720, 2304), (288, 2304), (22528, 2304),
                (18432, 2304)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K", MODEL_SHAPES)
@pytest.mark.parametrize("M", [1, 2, 4])
def test_gemv_model_shapes_gpu(N, K, M):
    gc.check_gemv("cuda", M, N, K, BF16, BF16, seed=M)
    gc.check_gemv("cuda", M, N, K, BF16, F32, seed=M + 10)               # bf16 x, fp32 weight


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M", [1, 2])
def test_gemv_swiglu_dense_down_gpu(M):
    """Layer 0's down projection reading silu(gate) * up (or SiTU) of the gate|up GEMV's
    output."""
    gc.check_gemv("cuda", M, 2304, 9216, BF16, BF16, swiglu=True, seed=M)
    gc.check_gemv("cuda", M, 2304, 9216, BF16, BF16, swiglu=True, pdl=True, seed=M)
    gc.check_gemv("cuda", M, 300, 100, F32, F32, swiglu=True, strided_in=True, seed=M)
    # Kimi K3's SiTU MLPs: kimi-k3-mini's shared expert / dense layer, K3's shared experts
    gc.check_gemv("cuda", M, 2048, 2048, BF16, BF16, situ=(4.0, 25.0), pdl=True, seed=M)
    gc.check_gemv("cuda", M, 2048, 4096, BF16, BF16, situ=(4.0, 25.0), seed=M)
    gc.check_gemv("cuda", M, 7168, 6144, BF16, BF16, situ=(4.0, 25.0), pdl=True, seed=M)


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


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M", [1, 2])
def test_gemv_batched_mla_shapes_gpu(M):
    """MLA's per-head products at Kimi-Linear-48B's shapes (32 heads): q_nope x W_UK
    (W_UK^T rows [512, 128]) and o_lat x W_UV ([128, 512]), strided views in and out, with and
    without pdl; and equal to the einsums the layer runs otherwise within bf16 rounding."""
    for N, K in ((512, 128), (128, 512)):
        for pdl in (False, True):
            gc.check_gemv_batched("cuda", 32, M, N, K, BF16, pdl=pdl, seed=N + M)
    g = torch.Generator(device="cuda").manual_seed(M)
    q = torch.randn(M, 32, 192, generator=g, device="cuda").to(BF16)       # [M, H, qk]
    w_uk = (torch.randn(32, 128, 512, generator=g, device="cuda") * 0.05).to(BF16)
    want = torch.einsum("bhn,hnr->bhr", q[..., :128], w_uk)                # [M, H, rank]
    got = torch.empty_like(want)
    gemv_batched(q[..., :128].transpose(0, 1), w_uk.transpose(1, 2).contiguous(),
                 out=got.transpose(0, 1), pdl=True)
    assert kc.rel_err(got, want) < 1e-2


# The KDA layer's fused input projection (q|k|v|f_a|g_a|b: 3 * 4096 + 128 + 128 + 32 rows) and
# its o_proj: the two decode GEMVs around the attention at batch 1.
KDA_IN, O_PROJ = (12576, 2304), (2304, 4096)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K", [KDA_IN, O_PROJ])
@pytest.mark.parametrize("M", [1, 2])
def test_gemv_pdl_matches_gpu(N, K, M):
    """pdl=True (prefetch 0, 1, 2 tiles) equals pdl=False bit for bit, and the reference."""
    for prefetch in (0, 1, 2):
        cfg = replace(default_config(M, N, K, BF16, torch.device("cuda")), prefetch=prefetch)
        gc.check_pdl_same("cuda", M, N, K, BF16, config=cfg, seed=prefetch)
        gc.check_pdl_same("cuda", M, N, K, BF16, config=GemvConfig(16, 1024, 4, 3, prefetch),
                          strided_in=True, seed=prefetch)   # K=2304: masked tiles
    gc.check_gemv("cuda", M, N, K, BF16, BF16, seed=M, pdl=True)
    gc.check_pdl_same("cuda", M, 1000, K + 8, BF16, seed=M)                 # masked K


def _chain(h, res, layers, pdl):
    """add+RMSNorm -> in-proj GEMV -> o_proj GEMV on its first 4096 columns, per layer; the
    o_proj output is the next layer's norm input. Returns (h [M, 2304], residual)."""
    from kdaserve.kernels.norm.rms_norm import add_rms_norm

    for norm_w, w_in, w_o in layers:
        x, res = add_rms_norm(h, norm_w, 1e-5, res, pdl=pdl)          # [M, 2304] each
        proj = gemv(x, w_in, pdl=pdl)                                   # [M, 12576]
        h = gemv(proj[:, :O_PROJ[1]], w_o, pdl=pdl)                     # [M, 2304]
    return h, res


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M", [1, 2])
def test_pdl_chain_in_cuda_graph_gpu(M):
    """norm -> gemv -> gemv x 3 layers captured with PDL launches: every replay equals the
    eager pdl=False chain bit for bit, and a replay after new inputs reads them."""
    g = torch.Generator(device="cuda").manual_seed(M)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(BF16)

    layers = [(rnd(2304, scale=0.1) + 1, rnd(*KDA_IN, scale=KDA_IN[1] ** -0.5),
               rnd(*O_PROJ, scale=O_PROJ[1] ** -0.5)) for _ in range(3)]
    h_in, res_in = rnd(M, 2304), rnd(M, 2304)
    want = _chain(h_in, res_in, layers, pdl=False)
    eager = _chain(h_in, res_in, layers, pdl=True)
    assert all(torch.equal(a, b) for a, b in zip(eager, want)), "eager pdl chain differs"
    graph, out = kc.capture_graph(lambda: _chain(h_in, res_in, layers, pdl=True))
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, want)), "graph replay differs"
    h_in.copy_(rnd(M, 2304))
    res_in.copy_(rnd(M, 2304))
    want = _chain(h_in, res_in, layers, pdl=False)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, want)), "replay did not read new inputs"
