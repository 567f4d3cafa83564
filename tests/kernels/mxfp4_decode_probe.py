"""Probe kernels for the checks: the MXFP4 weight decode of the expert GEMMs
(kernels/moe/triton_mxfp4_moe.py _weight_tile, both decodes) and the GEMV's table lookups
(_e2m1_pair_lut), stored instead of multiplied, so that every decoded value can be compared
bit for bit with kernels/mxfp4/format.py.

A module of its own (not part of a check script) so that the launches record_launches.py sees
name an importable module and test_compile_sm90.py compiles the probe for sm_90 as well.
"""

import triton
import triton.language as tl

from kdaserve.kernels.moe.triton_mxfp4_moe import _e2m1_pair_lut, _lut_tables, _weight_tile


@triton.jit
def mxfp4_decode_probe_kernel(w_ptr, s_ptr, out_ptr, table_ptr, expert, n_rows, half_k,
                              stride_we, stride_wn, stride_se, stride_sn, stride_om,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              LUT: tl.constexpr = False):
    """out[n, k] = the decoded weight [n, k] of expert `expert` in out_ptr's dtype: program i
    covers rows [i * BLOCK_N, (i + 1) * BLOCK_N) and walks K in tiles of BLOCK_K, the low
    nibbles going to the even K columns and the high ones to the odd, as in the GEMMs. LUT:
    the table-lookup decode (table_ptr: LUT_TABLE_WORDS), else the bit decode."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_rows
    BKH: tl.constexpr = BLOCK_K // 2
    dtype = out_ptr.dtype.element_ty
    table_h, table_l = _lut_tables(table_ptr, LUT)
    for j0 in range(0, half_k, BKH):
        lo, hi = _weight_tile(w_ptr, s_ptr, expert, offs_n, mask_n, j0, half_k, stride_we,
                              stride_wn, stride_se, stride_sn, BKH, dtype, True, LUT, table_h,
                              table_l)                                           # [BKH, BN]
        j = j0 + tl.arange(0, BKH)
        ptrs = out_ptr + offs_n[None, :].to(tl.int64) * stride_om + 2 * j[:, None]
        mask = (j < half_k)[:, None] & mask_n[None, :]
        tl.store(ptrs, lo, mask=mask)
        tl.store(ptrs + 1, hi, mask=mask)


@triton.jit
def mxfp4_lut_probe_kernel(codes_ptr, lo_ptr, hi_ptr, table_ptr, n, BLOCK: tl.constexpr):
    """lo[i], hi[i] = the fp32 values of the low and high nibble of byte codes[i], through the
    GEMV's byte-permute decode (_e2m1_pair_lut: PTX; under the interpreter, the checks' model
    of it) with its table words read as the GEMV reads them (table_ptr: LUT_TABLE_WORDS)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    table_h, table_l = _lut_tables(table_ptr, True)
    lo, hi = _e2m1_pair_lut(tl.load(codes_ptr + offs, mask=mask, other=0), table_h, table_l)
    tl.store(lo_ptr + offs, lo, mask=mask)
    tl.store(hi_ptr + offs, hi, mask=mask)
