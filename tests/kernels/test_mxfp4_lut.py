"""The MXFP4 GEMV's byte-permute decode (kernels/moe/triton_mxfp4_moe.py E2M1_LUT_ASM), without
a GPU: its PTX text run through ptx_model.py (the instructions it uses) over every byte value in
every byte position, against the OCP E2M1 values bit for bit; and the GEMV built with it for
sm_90, whose K loop must be shorter than the bit-by-bit decode's. The whole GEMV with the
decode runs against its twin under the interpreter (mxfp4_moe_checks.py check_lut_decode, the
same PTX model standing in for inline asm) and on a GPU (test_mxfp4_moe.py)."""

import struct
from pathlib import Path

import numpy as np
import pytest
from ptx_model import MASK, run_ptx
from ptx_model import prmt as _prmt

from kdaserve.kernels.mxfp4.format import E2M1_VALUES as E2M1


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def test_prmt_model():
    # the selector picks bytes of {b, a}; bit 3 of a nibble replicates the picked byte's sign
    assert _prmt(0x33221100, 0x77665544, 0x3210) == 0x33221100
    assert _prmt(0x33221100, 0x77665544, 0x4567) == 0x44556677
    assert _prmt(0x00007F80, 0, 0x1498) == 0x7F0000FF


def test_lut_decode_is_exact_for_every_byte_in_every_position():
    from kdaserve.kernels.moe.triton_mxfp4_moe import E2M1_LUT_ASM, LUT_TABLE_WORDS

    asm = E2M1_LUT_ASM.value
    table_h, table_l = LUT_TABLE_WORDS
    rng = np.random.default_rng(0)
    words = [b << (8 * pos) | int(rng.integers(0, 2**32)) & ~(0xFF << (8 * pos)) & MASK
             for pos in range(4) for b in range(256)]
    words += [int(w) for w in rng.integers(0, 2**32, size=256, dtype=np.uint64)]
    for w in words:
        out = run_ptx(asm, {8: w, **dict.fromkeys(range(9, 13), table_h),
                            **dict.fromkeys(range(13, 17), table_l)})
        assert sorted(out) == list(range(8))
        for i in range(4):
            byte = (w >> (8 * i)) & 0xFF
            assert out[i] == _bits(E2M1[byte & 15]), (hex(w), i, "low nibble")
            assert out[4 + i] == _bits(E2M1[byte >> 4]), (hex(w), i, "high nibble")


def test_run_ptx_rejects_unmodelled_instructions():
    with pytest.raises(NotImplementedError):
        run_ptx("{ add.u32 $0, $8, 1; }", {8: 1})


def test_lut_gemv_k_loop_is_shorter_for_sm90():
    """gemv1 (gate and up, SiTU) at kimi-k3-mini's measured GEMV tile (block_n 8, block_k 256,
    2 warps), bf16 activations: the K loop with LUT decodes with prmt and has fewer
    instructions than the bit decode (the loop is instruction-bound at one token), and its
    table words stay in registers (no per-prmt move of an immediate: at most a few IMAD)."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
        pytest.skip("triton's bundled nvdisasm is missing")
    import gemv_checks as gc

    from kdaserve.kernels.moe.triton_mxfp4_moe import mxfp4_moe_gemv1_kernel

    types = dict(x_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", inter_ptr="*bf16", topk_ids_ptr="*i32",
                 table_ptr="*i32", beta="fp32", linear_beta="fp32",
                 **dict.fromkeys(("inter_size", "hidden", "top_k", "num_experts", "stride_xm",
                                  "stride_we", "stride_wn", "stride_se", "stride_sn",
                                  "stride_im"), "i32"))
    loops = {}
    for lut in (False, True):
        k = gc.sm90_compile(mxfp4_moe_gemv1_kernel, types,
                            dict(BLOCK_N=8, BLOCK_K=256, ACT=1, CLIP_UP=False, MXFP4=True,
                                 USE_PDL=True, LUT=lut), num_warps=2, launch_pdl=True)
        (loop,) = gc.sass_loops(k)
        loops[lut] = loop
    assert loops[True].count("PRMT") >= 2 * 10 * 4           # 10 prmt a word, 4 words a tile
    assert len(loops[True]) < 0.8 * len(loops[False]), (len(loops[True]), len(loops[False]))
    assert loops[True].count("IMAD") < 60, loops[True].count("IMAD")
    assert loops[True].count("FFMA") == 2 * 32 + 2             # one chain a tile, the scales


def test_lut_gemm_k_loop_is_shorter_for_sm90():
    """gemm2 (the tl.dot form) at each tile class of default_config, bf16 activations: the K
    loop with the table decode has fewer instructions than with the bit decode (at the
    prefill tiles the loop issues more than its wgmma take)."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
        pytest.skip("triton's bundled nvdisasm is missing")
    import gemv_checks as gc

    from kdaserve.kernels.moe.mxfp4_moe import GEMM_CLASSES
    from kdaserve.kernels.moe.triton_mxfp4_moe import mxfp4_moe_gemm2_kernel

    types = dict(inter_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", out_ptr="*bf16",
                 **dict.fromkeys(("sorted_ids_ptr", "expert_ids_ptr", "expert_start_ptr",
                                  "counts_ptr", "num_rows_ptr", "table_ptr"), "*i32"),
                 **dict.fromkeys(("hidden", "inter_size", "max_blocks", "num_experts",
                                  "stride_im", "stride_we", "stride_wn", "stride_se",
                                  "stride_sn", "stride_om"), "i32"))
    for _, t in GEMM_CLASSES:
        sizes = {}
        for lut in (False, True):
            k = gc.sm90_compile(mxfp4_moe_gemm2_kernel, types,
                                dict(BLOCK_M=t["block_m"], BLOCK_N=t["block_n"],
                                     BLOCK_K=t["block_k"], GROUP_M=t["group_m"],
                                     DOT_PRECISION="tf32", LUT=lut),
                                num_warps=t["num_warps"], launch_pdl=False)
            sizes[lut] = len(max(gc.sass_loops(k), key=len))
        assert sizes[True] < 0.85 * sizes[False], (t, sizes)
