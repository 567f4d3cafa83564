"""The MXFP4 GEMV's byte-permute decode (kernels/moe/triton_mxfp4_moe.py E2M1_LUT_ASM), without
a GPU: its PTX text run through a model of the five instructions it uses, over every byte value
in every byte position, against the OCP E2M1 values bit for bit; and the GEMV built with it for
sm_90, whose K loop must be shorter than the bit-by-bit decode's. (On a GPU the GEMV itself is
checked against its twin: test_mxfp4_moe.py test_gemv_expert_gemms_on_gpu.)"""

import re
import struct
from pathlib import Path

import numpy as np
import pytest

MASK = 0xFFFFFFFF
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
"""The OCP MX spec's E2M1 values by code (sign bit 3)."""


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte sel[4i+2:4i] of {b, a} (a's
    bytes 0-3, b's 4-7), or that byte's bit 7 replicated when sel bit 4i+3 is set."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = pool[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def run_ptx(asm: str, operands: dict[int, int]) -> dict[int, int]:
    """Run the straight-line PTX of an inline-asm block: .reg declarations and and / or /
    shl / shr.u32 / mov / prmt on .b32 values; $n operands from `operands`; returns every $n
    written. Anything else raises, so a new instruction cannot pass unmodelled."""
    regs = {f"${k}": v & MASK for k, v in operands.items()}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"0[xX][0-9a-fA-F]+|\d+", tok):
            return int(tok, 0) & MASK
        raise KeyError(f"operand {tok!r} read before written")

    for line in asm.replace("{", ";").replace("}", ";").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [t.strip() for t in args.split(",")]
        v = [val(t) for t in src]
        if op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "shl.b32":
            r = (v[0] << v[1]) & MASK if v[1] < 32 else 0
        elif op == "shr.u32":
            r = v[0] >> v[1] if v[1] < 32 else 0
        elif op == "mov.b32":
            r = v[0]
        elif op == "prmt.b32":
            r = _prmt(*v)
        else:
            raise NotImplementedError(f"PTX op {op} is not modelled")
        regs[d] = r
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$") and int(k[1:]) < 8}


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
