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


def test_mxfp4_decode_sm90_has_no_exp2():
    """The weight decode compiles for sm_90 (no GPU needed) to integer ops and one multiply:
    no ex2 in the probe kernel (decode only), nor in gemm2 (decode + MMA, no activation) at
    each tile class of default_config."""
    from pathlib import Path

    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")
    import gemv_checks as gc
    from mxfp4_decode_probe import mxfp4_decode_probe_kernel

    from kdaserve.kernels.moe.mxfp4_moe import GEMM_CLASSES
    from kdaserve.kernels.moe.triton_mxfp4_moe import mxfp4_moe_gemm2_kernel

    ints = ("n_rows", "half_k", "expert", "stride_we", "stride_wn", "stride_se", "stride_sn",
            "stride_om")
    probe = gc.sm90_compile(mxfp4_decode_probe_kernel,
                            dict(w_ptr="*u8", s_ptr="*u8", out_ptr="*bf16", table_ptr="*i32",
                                 **dict.fromkeys(ints, "i32")), dict(BLOCK_N=64, BLOCK_K=128),
                            num_warps=4, launch_pdl=False)
    assert "ex2" not in probe.asm["ptx"]
    ptrs = dict(inter_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", out_ptr="*bf16",
                **dict.fromkeys(("sorted_ids_ptr", "expert_ids_ptr", "expert_start_ptr",
                                 "counts_ptr", "num_rows_ptr", "table_ptr"), "*i32"))
    ints = ("hidden", "inter_size", "max_blocks", "num_experts", "stride_im", "stride_we",
            "stride_wn", "stride_se", "stride_sn", "stride_om")
    for _, t in GEMM_CLASSES:
        k = gc.sm90_compile(mxfp4_moe_gemm2_kernel, dict(ptrs, **dict.fromkeys(ints, "i32")),
                            dict(BLOCK_M=t["block_m"], BLOCK_N=t["block_n"],
                                 BLOCK_K=t["block_k"], GROUP_M=t["group_m"],
                                 DOT_PRECISION="tf32"), num_warps=t["num_warps"],
                            launch_pdl=False)
        ptx = k.asm["ptx"]
        assert "ex2" not in ptx and ("wgmma" in ptx) == (t["block_m"] >= 64), t


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MINI = dict(E=64, k=16, D=2048, inter=2048)
"""kimi-k3-mini's expert shapes (latent 2048, intermediate 2048, top-16; 64 of its 256
experts)."""


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_decode_exact_on_gpu(dtype):
    """Every code under every scale byte decodes bit-exactly on the device (scale byte 0 is an
    fp32 subnormal: this fails if the multiply or the bf16 cast flushes it)."""
    import mxfp4_moe_checks as checks

    checks.check_decode_exact("cuda", dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block,warps", [(256, 4), (1024, 1)])
def test_mxfp4_lut_decode_exact_on_gpu(block, warps):
    """The GEMV's byte-permute decode (PTX) gives every byte's two E2M1 values bit for bit in
    every position of its four-byte groups (2 and 32 bytes a thread)."""
    import mxfp4_moe_checks as checks

    checks.check_lut_probe("cuda", block, warps)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N", [1, 5, 64, 300, 2048])
@pytest.mark.parametrize("act", ["silu", "situ"])
def test_mxfp4_expert_gemms_on_gpu(N, act):
    """The MXFP4 expert GEMMs (N=1: the direct decode path; else through the block align), at
    each tile class of default_config (N = 300: 75 rows per expert; 2048: 512, prefill)."""
    import mxfp4_moe_checks as checks

    kw = dict(beta=4.0, linear_beta=25.0) if act == "situ" else {}
    checks.check_partials("cuda", torch.bfloat16, N=N, act=act, seed=N, **MINI, **kw)
    checks.check_partials("cuda", torch.bfloat16, N=N, act=act, bad_id=True, seed=N + 1,
                          E=64, k=8, D=512, inter=256, **kw)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N", [1, 5, 64, 300, 2048])
def test_bf16_expert_gemms_on_gpu(N):
    """The same kernels reading dense bf16 experts (the ablation baseline)."""
    import mxfp4_moe_checks as checks

    checks.check_partials("cuda", torch.bfloat16, N=N, act="situ", beta=4.0, linear_beta=25.0,
                          dense=True, seed=N, **MINI)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N", [1, 7])
@pytest.mark.parametrize("dense,lut", [(False, True), (False, False), (True, True)])
@pytest.mark.parametrize("act", ["silu", "situ"])
def test_gemv_expert_gemms_on_gpu(N, dense, lut, act):
    """The GEMV form of the expert GEMMs (GEMM_GEMV, opt-in through config=) at kimi-k3-mini's
    shapes, MXFP4 (table-lookup and bit decodes) and dense, and at a small shape with -1
    entries and block_n 8."""
    import mxfp4_moe_checks as checks

    from kdaserve.kernels.moe.mxfp4_moe import GEMM_GEMV, Mxfp4MoEConfig

    kw = dict(beta=4.0, linear_beta=25.0) if act == "situ" else {}
    checks.check_partials("cuda", torch.bfloat16, N=N, act=act, dense=dense, seed=N,
                          config=Mxfp4MoEConfig(**GEMM_GEMV, lut_decode=lut), **MINI, **kw)
    checks.check_partials("cuda", torch.bfloat16, N=N, act=act, dense=dense, bad_id=True,
                          seed=N + 1, E=64, k=8, D=512, inter=256, **kw,
                          config=Mxfp4MoEConfig(block_m=1, block_n=8, block_k=512,
                                                lut_decode=lut))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N", [1, 7, 15, 16, 64, 200, 2048])
@pytest.mark.parametrize("norm,residual", [(True, True), (False, True), (True, False)])
def test_fused_tail_on_gpu(N, norm, residual):
    """The tail launch: top-k weighted sum + latent norm + up projection (+ shared output), at
    each tail tile class of default_config."""
    import mxfp4_moe_checks as checks

    checks.check_tail("cuda", torch.bfloat16, N=N, k=8, E=256, L=1024, H=2048, norm=norm,
                      residual=residual, seed=N)
    checks.check_tail("cuda", torch.bfloat16, N=N, k=16, E=256, L=2048, H=2048, norm=norm,
                      residual=residual, seed=N + 2)                    # kimi-k3-mini's
    checks.check_tail("cuda", torch.bfloat16, N=N, k=8, L=80, H=48, bad_id=True, seed=N + 1)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N", [1, 16, 2048])
def test_latent_moe_kernels_compose_on_gpu(N):
    """Partials then tail equal the unfused math (weighted sum, norm, up projection)."""
    import mxfp4_moe_checks as checks

    checks.check_layer("cuda", torch.bfloat16, N=N, E=64, k=8, L=1024, inter=768, H=2048)
    checks.check_layer("cuda", torch.bfloat16, N=N, E=64, k=16, L=2048, inter=2048, H=2048)

