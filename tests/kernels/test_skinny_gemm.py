"""Skinny GEMM (kdaserve.kernels.linear.skinny, 3..64 rows on the tensor cores) vs F.linear
in fp64.

The interpreter subset runs in a subprocess with TRITON_INTERPRET=1; input checks run without
triton; the guessed production tiles compile for sm_90 on the CPU (no spills, PDL order); GPU
tests (marked gpu) run the Kimi-Linear-48B projection shapes at decode and verify row counts.
"""

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import gemv_checks as gc
import kernel_checks as kc
import skinny_checks as sc
from kdaserve.kernels.linear.skinny import (MAX_M, MIN_M, SkinnyConfig, block_m, default_config,
                                            guess_config, skinny_gemm, tuned_configs)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16, F32 = torch.bfloat16, torch.float32
# Kimi-Linear-48B: KDA q|k|v|gates, o_proj, MLA q|kv_a, layer 0's gate|up and down
MODEL_SHAPES = [(12576, 2304), (2304, 4096), (6720, 2304), (18432, 2304), (2304, 9216)]


def test_skinny_interpreter():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("skinny_checks.py", timeout=120)
    assert proc.returncode == 0 and "passed" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("x_shape,w_shape,match", [
    ((2, 64), (32, 64), "M=2"),
    ((65, 64), (32, 64), "M=65"),
    ((4, 64), (32, 100), "x K=64 != weight K=100"),
    ((4, 64, 1), (32, 64), r"x must be \[M, K\]"),
])
def test_bad_shapes_name_the_value(x_shape, w_shape, match):
    with pytest.raises(ValueError, match=match):
        skinny_gemm(torch.randn(*x_shape, dtype=BF16), torch.randn(*w_shape, dtype=BF16))


def test_bad_dtypes_layouts_and_configs_name_the_value():
    x, w = torch.randn(4, 64, dtype=BF16), torch.randn(32, 64, dtype=BF16)
    with pytest.raises(ValueError, match="share a dtype.*torch.bfloat16 and torch.float32"):
        skinny_gemm(x, w.float())
    with pytest.raises(ValueError, match="weight must have a contiguous last dim"):
        skinny_gemm(x, torch.randn(64, 32, dtype=BF16).t())
    with pytest.raises(ValueError, match=r"out must be \[M=4, N=32\].*\(4, 31\)"):
        skinny_gemm(x, w, out=torch.empty(4, 31, dtype=BF16))
    with pytest.raises(ValueError, match="out dtype torch.float32 != out_dtype torch.bfloat16"):
        skinny_gemm(x, w, out=torch.empty(4, 32), out_dtype=BF16)
    with pytest.raises(ValueError, match="block_n must be a power of two.*got 24"):
        skinny_gemm(x, w, config=SkinnyConfig(24, 128, 4, 2))
    with pytest.raises(ValueError, match="num_stages must be >= 1, got 0"):
        skinny_gemm(x, w, config=SkinnyConfig(16, 128, 4, 0))
    with pytest.raises(ValueError, match="prefetch must be 0 or 1, got 2"):
        skinny_gemm(x, w, config=SkinnyConfig(16, 128, 4, 2, prefetch=2))


@pytest.mark.parametrize("M,bm", [(3, 16), (16, 16), (17, 32), (33, 64), (64, 64)])
def test_block_m_buckets(M, bm):
    assert block_m(M) == bm and MIN_M <= M <= MAX_M


@pytest.mark.parametrize("N,K", MODEL_SHAPES + [(40, 100)])
@pytest.mark.parametrize("bm", [16, 32, 64])
def test_guess_config(N, K, bm):
    cfg = guess_config(bm, N, K)
    assert cfg.block_n == (32 if -(-N // 32) >= 66 else 16)
    short_k = max(32, 1 << (K - 1).bit_length())                       # next power of two
    assert cfg.block_k == ((512 if K >= 4096 and bm <= 32 else 128) if K >= 128 else short_k)
    assert (bm + cfg.block_n) * cfg.block_k * 2 * cfg.num_stages <= 160 * 1024 or \
        cfg.num_stages == 2
    assert default_config(bm, N, K, BF16) == (tuned_configs(None, 132).get(
        f"M={bm},N={N},K={K},dtype=bfloat16") or cfg)


def test_tuned_configs_are_valid():
    """Every stored config is a valid tile for its shape's row bucket."""
    from kdaserve.kernels.configs import CONFIG_DIR

    for path in CONFIG_DIR.glob("skinny_gemm_*.json"):
        import json
        for key, fields in json.loads(path.read_text()).items():
            dims = dict(kv.split("=") for kv in key.split(","))
            assert int(dims["M"]) in (16, 32, 64), (path.name, key)
            cfg = SkinnyConfig(**fields)
            assert cfg.block_n in (16, 32, 64, 128, 256) and cfg.num_stages >= 1, (path, key)


def _ptxas():
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")


TYPES = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32", K="i32",
             stride_xm="i32", stride_wn="i32", stride_om="i32")


@pytest.mark.parametrize("N,K", [(12576, 2304), (2304, 4096)])
@pytest.mark.parametrize("bm", [16, 32, 64])
def test_guessed_tiles_compile_for_sm90_without_spills(N, K, bm, tmp_path):
    """The production tiles (constexprs the interpreter's small shapes never reach) build for
    sm_90 within its shared memory and without register spills (ptxas -v)."""
    _ptxas()
    import triton
    from kdaserve.kernels.linear.triton_skinny import skinny_gemm_kernel

    cfg = guess_config(bm, N, K)
    k = gc.sm90_compile(skinny_gemm_kernel, TYPES,
                        dict(BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                             EVEN_K=K % cfg.block_k == 0, STAGES=cfg.num_stages, USE_PDL=True),
                        num_warps=cfg.num_warps, launch_pdl=True)
    assert k.metadata.shared <= 227 * 1024, (cfg, k.metadata.shared)
    (tmp_path / "k.ptx").write_text(k.asm["ptx"])
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    res = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o",
                          str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in res.stderr, (cfg, res.stderr)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_pdl_sm90_order(prefetch):
    """griddepcontrol.wait comes before every x load (x is the previous kernel's output) and
    the store, launch_dependents right after it; before it only the prefetched weight tile's
    16-byte loads (32 x 256 bf16 over 128 threads: 8 a thread)."""
    _ptxas()
    from kdaserve.kernels.linear.triton_skinny import skinny_gemm_kernel

    k = gc.sm90_compile(skinny_gemm_kernel, TYPES,
                        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, EVEN_K=True, STAGES=4,
                             USE_PDL=True, PREFETCH=prefetch), num_warps=4, launch_pdl=True)
    ptx = k.asm["ptx"]
    before, after = gc.split_at_wait(ptx)
    assert "cp.async" not in ptx[:ptx.index("griddepcontrol.wait")]
    assert len(before) == prefetch * 32 * 256 * 2 // (128 * 16), before
    assert all(op.startswith("ld.global.v4") for op in before), before
    assert after[0].startswith("griddepcontrol.launch_dependents"), after[:2]
    assert any(op.startswith("st.global") for op in after)
    assert "mma.sync" in ptx or "wgmma" in ptx                          # tensor cores


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,K", MODEL_SHAPES)
@pytest.mark.parametrize("M", [3, 9, 16, 32, 33, 64])
def test_skinny_model_shapes_gpu(N, K, M):
    sc.check_skinny("cuda", M, N, K, seed=M)
    sc.check_skinny("cuda", M, N, K, out_dtype=F32, strided_in=True, seed=M + 1, bound=1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M", [5, 16, 64])
def test_skinny_pdl_and_graph_match_gpu(M):
    """pdl=True and a CUDA-graph replay give the eager pdl=False output bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, 4096, device="cuda", generator=g).to(BF16)
    w = (torch.randn(2304, 4096, device="cuda", generator=g) * 4096 ** -0.5).to(BF16)
    base = skinny_gemm(x, w)
    assert torch.equal(skinny_gemm(x, w, pdl=True), base)
    first_tile = replace(default_config(M, 2304, 4096, BF16, x.device), prefetch=1)
    assert torch.equal(skinny_gemm(x, w, config=first_tile, pdl=True), base)
    out = torch.empty_like(base)
    skinny_gemm(x, w, out=out, pdl=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_gemm(x, w, out=out, pdl=True)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, base)


@pytest.mark.gpu
@gpu
def test_skinny_odd_shapes_and_configs_gpu():
    for cfg in (SkinnyConfig(16, 64, 2, 2), SkinnyConfig(64, 128, 8, 4),
                SkinnyConfig(128, 128, 4, 3)):
        sc.check_skinny("cuda", 7, 1000, 333, config=cfg, strided_out=True)
        sc.check_skinny("cuda", 40, 300, 2304, config=cfg, dtype=torch.float16)
