"""Triton kernels of the MXFP4 latent MoE (imported lazily by mxfp4_moe.py).

Weights stay 4-bit in memory (kernels/mxfp4/format.py layout): every weight tile is loaded as
packed bytes [BLOCK_K / 2, BLOCK_N] plus its E8M0 scales (one per 16 packed bytes, loaded once
per group), decoded in registers and multiplied as two half-K products, the even K columns
(low nibbles) and the odd ones (high nibbles), so no interleave is needed. The decode (exact:
an E2M1 value times a power of two) is by byte-permute table lookups (E2M1_LUT_ASM, LUT) with
bf16 activations, bit by bit otherwise (fp32: the interpreter's checks).
MXFP4=False reads dense [E, N, K] weights the same way: the bf16 baseline of the same layer.
Routing entries are the flattened top-k pairs r = n * top_k + j, grouped by expert with
fused_moe's alignment (or one entry per row block for one token, DIRECT).

  1. mxfp4_moe_gemm1_kernel  inter[r] = act(x[n] @ W1_e^T, x[n] @ W3_e^T)   (silu * up, or SiTU)
  2. mxfp4_moe_gemm2_kernel  partial[r] = inter[r] @ W2_e^T                  (unweighted)
     mxfp4_moe_gemv1_kernel / mxfp4_moe_gemv2_kernel: the same two products for one or a few
     tokens without tl.dot (Mxfp4MoEConfig.block_m = 1): one program per (routing entry,
     column tile), no alignment, the packed weight tile [BLOCK_N, BLOCK_K / 2] reduced along K.
  3. latent_moe_tail_kernel  out[n] = r_n * ((sum_j w[n, j] partial[n k + j]) * g) @ W_up^T
                                      + residual[n],  r_n = rsqrt(mean(lat_n^2) + eps)
     The top-k weighted sum is computed inside the tail, per K chunk of the latent, and never
     stored: no finalize launch, no [N, L] round trip. The RMSNorm scale is a per-row scalar,
     so it applies after the up-projection's K loop (one pass over the latent).
     latent_moe_tail_gemv_kernel is the same tail for a few tokens, without tl.dot.
"""

import triton
import triton.language as tl

from kdaserve.kernels.moe.triton_moe import _block_rows, _grouped_pid
from kdaserve.kernels.triton_pdl import pdl_wait


@triton.jit
def _e2m1(code):
    """int32 E2M1 codes (0..15) -> fp32 values, exactly, from bits (no exp2, no select): the
    exponent and mantissa bits (code & 7) go to fp32's bits 22..24 and the sign (code bit 3) to
    bit 31. That pattern is the value times 2^-126 (E2M1's subnormal 0.5 an fp32 subnormal,
    kept by the non-ftz multiply); one multiply by 2^126 makes it the value. Code 8 is -0.0."""
    bits = ((code << 22) & 0x01C00000) | ((code << 28) & -2147483648)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37               # 2^126


@triton.jit
def _e2m1_pair_tiny(byte):
    """int32 packed bytes (0..255) -> (low nibble, high nibble) as E2M1 value x 2^-126 in fp32:
    _e2m1's bit patterns without its multiply, placed straight from the byte (the shifts and
    masks drop the other nibble's bits, so no `& 15` or `>> 4` first). The GEMV scales its
    activations by 2^63 and each group's sum by 2^63 instead: every product stays a normal
    fp32 (value x activation x 2^-63), two multiplies a byte fewer."""
    lo = ((byte << 22) & 0x01C00000) | ((byte << 28) & -2147483648)
    hi = ((byte << 18) & 0x01C00000) | ((byte << 24) & -2147483648)
    return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)


TWO_POW_63 = tl.constexpr(9.223372036854775808e18)

# E2M1 bytes -> fp32 by byte-permute table lookups (PTX prmt), four packed bytes a call: per
# byte (low nibble = even K value, high nibble = odd), its two values exactly, sign included.
# A value's fp32 pattern is its bf16 pattern (high byte H, low byte L) followed by 16 zero
# bits, and E2M1's eight magnitudes have eight (H, L) pairs: one prmt per table looks up
# four magnitudes (selector = four 3-bit codes, their sign bits cleared). Signs: one prmt
# maps each nibble's sign bit, moved to bit 2 of its nibble, to 0x00 (byte 0 of a zero pool
# word, which needs no register) or 0x80 (byte 4), OR-ed into H. Then each byte's (L, H)
# pairs are placed side by side (a bf16 pair) and split into two fp32 words by a shift and a
# mask: 25 ops for 8 values, straight from the loaded word (the bit decode takes each byte
# out first, builds each value with shifts and masks, and scales the activations by 2^63);
# tests/kernels/test_mxfp4_lut.py holds the GEMV's K loop under 0.8x the bit decode's and
# each tl.dot class's under 0.85x.
# Tables: H = [00 3F 3F 3F 40 40 40 40], L = [00 00 80 C0 00 40 80 C0] for magnitudes 0..7
# (0, 0.5, 1, 1.5, 2, 3, 4, 6); prmt's pool {b, a} numbers a's bytes 0-3 and b's 4-7. The
# tables' low words (a, which must be a register) come in as operands, LUT_TABLE_WORDS read
# from memory once a program: as immediates, ptxas re-materialises them before every prmt.
# Registers: $0-$3 the low-nibble values of bytes 0-3, $4-$7 the high-nibble ones, $8 the
# four bytes (byte i = bits 8i..8i+7), $9 H's low word, $13 L's ($10-$12, $14-$16: the
# same words, an int32 operand taking one register per packed element).
# tests/kernels/test_mxfp4_lut.py runs this text through a PTX model over every byte value.
E2M1_LUT_ASM = tl.constexpr("""
{
.reg .b32 m, mh, s, sh, h0, h1, l0, l1, g0, g1, p0, p1, p2, p3;
and.b32 m, $8, 0x77777777;
shr.u32 mh, m, 16;
prmt.b32 h0, $9, 0x40404040, m;
prmt.b32 h1, $9, 0x40404040, mh;
prmt.b32 l0, $13, 0xC0804000, m;
prmt.b32 l1, $13, 0xC0804000, mh;
shr.u32 s, $8, 1;
and.b32 s, s, 0x44444444;
shr.u32 sh, s, 16;
prmt.b32 g0, 0, 0x80, s;
prmt.b32 g1, 0, 0x80, sh;
or.b32 h0, h0, g0;
or.b32 h1, h1, g1;
prmt.b32 p0, l0, h0, 0x5140;
prmt.b32 p1, l0, h0, 0x7362;
prmt.b32 p2, l1, h1, 0x5140;
prmt.b32 p3, l1, h1, 0x7362;
shl.b32 $0, p0, 16;
and.b32 $4, p0, 0xFFFF0000;
shl.b32 $1, p1, 16;
and.b32 $5, p1, 0xFFFF0000;
shl.b32 $2, p2, 16;
and.b32 $6, p2, 0xFFFF0000;
shl.b32 $3, p3, 16;
and.b32 $7, p3, 0xFFFF0000;
}
""")
LUT_TABLE_WORDS = (0x3F3F3F00, 0xC0800000)
"""The low words of E2M1_LUT_ASM's H and L tables ($9, $13), as the kernels read them."""


@triton.jit
def _e2m1_pair_lut(codes, table_h, table_l):
    """uint8 packed bytes -> (low nibble, high nibble) as exact fp32 values (E2M1_LUT_ASM, with
    its two table words; elementwise, so any grouping of four bytes a call gives the same
    result). PTX: the GPU, or Triton's interpreter given the tests' PTX model
    (tests/kernels/ptx_model.py)."""
    return tl.inline_asm_elementwise(E2M1_LUT_ASM, "=r,=r,=r,=r,=r,=r,=r,=r" + ",r" * 9,
                                     [codes, table_h, table_l], dtype=(tl.float32, tl.float32),
                                     is_pure=True, pack=4)


@triton.jit
def _lut_tables(table_ptr, LUT: tl.constexpr):
    """LUT_TABLE_WORDS from memory (so they sit in registers through the K loop), or zeros."""
    if LUT:
        return tl.load(table_ptr), tl.load(table_ptr + 1)
    return 0, 0


@triton.jit
def _quarters(t):
    """t [A, B, 4 n] -> four [A, B, n] tensors that together hold its elements (reshapes and
    splits of a dim each thread holds whole: no data moves); [A, B] each when n = 1."""
    A: tl.constexpr = t.shape[0]
    B: tl.constexpr = t.shape[1]
    C: tl.constexpr = t.shape[2]
    even, odd = tl.split(tl.reshape(t, [A, B, C // 2, 2]))
    if C == 4:
        e0, e1 = tl.split(even)
        o0, o1 = tl.split(odd)
    else:
        e0, e1 = tl.split(tl.reshape(even, [A, B, C // 4, 2]))
        o0, o1 = tl.split(tl.reshape(odd, [A, B, C // 4, 2]))
    return e0, o0, e1, o1


@triton.jit
def _pair_fma4(acc, lo, hi, x_lo, x_hi):
    """acc [A, B] + sum over the last dim (4) of lo * x_lo + hi * x_hi, as an fma chain."""
    l0, l1, l2, l3 = _quarters(lo)
    h0, h1, h2, h3 = _quarters(hi)
    a0, a1, a2, a3 = _quarters(x_lo)
    b0, b1, b2, b3 = _quarters(x_hi)
    acc = tl.fma(h0, b0, tl.fma(l0, a0, acc))
    acc = tl.fma(h1, b1, tl.fma(l1, a1, acc))
    acc = tl.fma(h2, b2, tl.fma(l2, a2, acc))
    return tl.fma(h3, b3, tl.fma(l3, a3, acc))


@triton.jit
def _pair_dot16(lo, hi, x_lo, x_hi):
    """sum over the last dim (16) of lo * x_lo + hi * x_hi: [A, B, 16] weights against
    [1, B, 16] activations -> [A, B], as one chain of 32 fma (tl.sum of the products would
    take a multiply, an fma and an add per pair)."""
    l0, l1, l2, l3 = _quarters(lo)
    h0, h1, h2, h3 = _quarters(hi)
    a0, a1, a2, a3 = _quarters(x_lo)
    b0, b1, b2, b3 = _quarters(x_hi)
    acc = tl.zeros([lo.shape[0], lo.shape[1]], dtype=tl.float32)
    acc = _pair_fma4(acc, l0, h0, a0, b0)
    acc = _pair_fma4(acc, l1, h1, a1, b1)
    acc = _pair_fma4(acc, l2, h2, a2, b2)
    return _pair_fma4(acc, l3, h3, a3, b3)


@triton.jit
def _e8m0(s):
    """int32 E8M0 bytes (0..255) -> 2^(s - 127) in fp32, exactly, from bits: s << 23 is the
    exponent field for s in 1..254; s = 0 and s = 255 also set mantissa bit 22, giving 2^-127
    (a subnormal) and a quiet NaN."""
    edge = ((s + 1) & 254) == 0                             # s == 0 or s == 255
    return ((s << 23) | tl.where(edge, 0x400000, 0)).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_tile(w_ptr, s_ptr, e, offs_n, mask_n, j0, half_k, stride_we, stride_wn,
                stride_se, stride_sn, BKH: tl.constexpr, DTYPE: tl.constexpr,
                LUT: tl.constexpr = False, table_h=0, table_l=0):
    """Decoded weight tile of rows offs_n, packed bytes j0 .. j0 + BKH (j0 a multiple of 16):
    (low [BKH, BN], high [BKH, BN]) in DTYPE, i.e. the K columns 2j and 2j + 1. The tile is
    handled as [G, 16, BN]: one E8M0 byte per 16 packed bytes (32 K values), loaded and decoded
    once per group of 16 and broadcast over it. LUT: the byte-permute decode (E2M1_LUT_ASM,
    with LUT_TABLE_WORDS), else bit by bit."""
    G: tl.constexpr = BKH // 16
    BN: tl.constexpr = offs_n.shape[0]
    offs_g = j0 // 16 + tl.arange(0, G)                                      # [G] scale columns
    mask_g = (offs_g < half_k // 16)[:, None] & mask_n[None, :]              # [G, BN]
    rows = offs_n[None, :].to(tl.int64)                                      # [1, BN]
    j = offs_g[:, None, None] * 16 + tl.arange(0, 16)[None, :, None]         # [G, 16, 1]
    codes = tl.load(w_ptr + e * stride_we + rows[None, :, :] * stride_wn + j,
                    mask=mask_g[:, None, :], other=0)                        # [G, 16, BN]
    scale = _e8m0(tl.load(s_ptr + e * stride_se + rows * stride_sn + offs_g[:, None],
                          mask=mask_g, other=127).to(tl.int32))[:, None, :]  # [G, 1, BN]
    if LUT:
        lo, hi = _e2m1_pair_lut(codes, table_h, table_l)
    else:
        codes = codes.to(tl.int32)
        lo, hi = _e2m1(codes & 15), _e2m1(codes >> 4)
    lo = tl.reshape(lo * scale, [BKH, BN])
    hi = tl.reshape(hi * scale, [BKH, BN])
    return lo.to(DTYPE), hi.to(DTYPE)


@triton.jit
def _weight_tile(w_ptr, s_ptr, e, offs_n, mask_n, j0, half_k, stride_we, stride_wn,
                 stride_se, stride_sn, BKH: tl.constexpr, DTYPE: tl.constexpr,
                 MXFP4: tl.constexpr, LUT: tl.constexpr = False, table_h=0, table_l=0):
    """(even-K columns, odd-K columns) [BKH, BN] of the weight rows offs_n for the packed
    positions j0 .. j0 + BKH: decoded from MXFP4 (LUT: by table lookups), or read from a dense
    [E, N, K] weight (the bf16 baseline; s_ptr unused)."""
    if MXFP4:
        lo, hi = _mxfp4_tile(w_ptr, s_ptr, e, offs_n, mask_n, j0, half_k, stride_we,
                             stride_wn, stride_se, stride_sn, BKH, DTYPE, LUT, table_h,
                             table_l)
    else:
        j = j0 + tl.arange(0, BKH)
        mask = (j < half_k)[:, None] & mask_n[None, :]
        ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + 2 * j[:, None]
        lo = tl.load(ptrs, mask=mask, other=0.0).to(DTYPE)
        hi = tl.load(ptrs + 1, mask=mask, other=0.0).to(DTYPE)
    return lo, hi


@triton.jit
def _tanh(z):
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@triton.jit
def _glu(g, u, beta, linear_beta, ACT: tl.constexpr, CLIP_UP: tl.constexpr):
    """The gated activation of the fp32 gate and up products. ACT 0: silu(g) * u; ACT 1: SiTU,
    beta * tanh(g / beta) * sigmoid(g) * u', with u' = linear_beta * tanh(u / linear_beta)
    when CLIP_UP, else u."""
    sig = 1.0 / (1.0 + tl.exp(-g))
    if ACT == 0:
        h = g * sig * u
    else:
        up = u
        if CLIP_UP:
            up = linear_beta * _tanh(u / linear_beta)
        h = beta * _tanh(g / beta) * sig * up
    return h


@triton.jit
def _even_odd_rows(a_base, valid, k0, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of the rows a_base [BLOCK_M, 1] (valid ones; the rest 0),
    read contiguously, as (even columns, odd columns) [BLOCK_M, BLOCK_K / 2]: the products
    with the low and high nibbles' weight tiles. (Two stride-2 loads cost more instructions.)"""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_base + offs_k[None, :], mask=valid[:, None] & (offs_k < K)[None, :],
                other=0.0)
    return tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))


@triton.jit(do_not_specialize=["max_blocks"])
def mxfp4_moe_gemm1_kernel(
    x_ptr, w_ptr, s_ptr, inter_ptr,
    sorted_ids_ptr, expert_ids_ptr, expert_start_ptr, counts_ptr, num_rows_ptr, table_ptr,
    inter_size, hidden, top_k, max_blocks, num_experts, beta, linear_beta,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_im,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, ACT: tl.constexpr,
    CLIP_UP: tl.constexpr, MXFP4: tl.constexpr = True, DIRECT: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, LUT: tl.constexpr = False,
):
    """ACT 0: silu(g) * u; ACT 1: SiTU, beta * tanh(g / beta) * sigmoid(g) * u', with
    u' = linear_beta * tanh(u / linear_beta) when CLIP_UP, else u. The activations are read
    contiguously, BLOCK_K a row, and split into their even and odd K columns in registers.
    LUT: the table-lookup weight decode (table_ptr: LUT_TABLE_WORDS)."""
    pdl_wait(USE_PDL)
    pid_m, pid_n = _grouped_pid(tl.program_id(0), max_blocks, tl.cdiv(inter_size, BLOCK_N),
                                GROUP_M)
    if not DIRECT:
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
    e, rows, valid = _block_rows(pid_m, sorted_ids_ptr, expert_ids_ptr, expert_start_ptr,
                                 counts_ptr, num_experts, BLOCK_M, DIRECT)
    tok = rows // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter_size
    BKH: tl.constexpr = BLOCK_K // 2
    half_k = hidden // 2
    dtype = x_ptr.dtype.element_ty
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    a_base = x_ptr + tok[:, None] * stride_xm
    table_h, table_l = _lut_tables(table_ptr, LUT)
    for j0 in range(0, half_k, BKH):
        a_even, a_odd = _even_odd_rows(a_base, valid, 2 * j0, hidden, BLOCK_M, BLOCK_K)
        g_lo, g_hi = _weight_tile(w_ptr, s_ptr, e, offs_n, mask_n, j0, half_k, stride_we,
                                  stride_wn, stride_se, stride_sn, BKH, dtype, MXFP4, LUT,
                                  table_h, table_l)
        u_lo, u_hi = _weight_tile(w_ptr, s_ptr, e, offs_n + inter_size, mask_n, j0, half_k,
                                  stride_we, stride_wn, stride_se, stride_sn, BKH, dtype, MXFP4,
                                  LUT, table_h, table_l)
        acc_g = tl.dot(a_even, g_lo, acc_g, input_precision=DOT_PRECISION)
        acc_g = tl.dot(a_odd, g_hi, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a_even, u_lo, acc_u, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a_odd, u_hi, acc_u, input_precision=DOT_PRECISION)
    h = _glu(acc_g, acc_u, beta, linear_beta, ACT, CLIP_UP)
    o_ptrs = inter_ptr + rows[:, None] * stride_im + offs_n[None, :]
    tl.store(o_ptrs, h.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["max_blocks"])
def mxfp4_moe_gemm2_kernel(
    inter_ptr, w_ptr, s_ptr, out_ptr,
    sorted_ids_ptr, expert_ids_ptr, expert_start_ptr, counts_ptr, num_rows_ptr, table_ptr,
    hidden, inter_size, max_blocks, num_experts,
    stride_im, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, MXFP4: tl.constexpr = True,
    DIRECT: tl.constexpr = False, USE_PDL: tl.constexpr = False, LUT: tl.constexpr = False,
):
    """partial[r] = inter[r] @ W2_e^T, unweighted (the tail applies the routing weights);
    activations and LUT as in mxfp4_moe_gemm1_kernel."""
    pdl_wait(USE_PDL)
    pid_m, pid_n = _grouped_pid(tl.program_id(0), max_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if not DIRECT:
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
    e, rows, valid = _block_rows(pid_m, sorted_ids_ptr, expert_ids_ptr, expert_start_ptr,
                                 counts_ptr, num_experts, BLOCK_M, DIRECT)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    BKH: tl.constexpr = BLOCK_K // 2
    half_k = inter_size // 2
    dtype = inter_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    a_base = inter_ptr + rows[:, None] * stride_im
    table_h, table_l = _lut_tables(table_ptr, LUT)
    for j0 in range(0, half_k, BKH):
        a_even, a_odd = _even_odd_rows(a_base, valid, 2 * j0, inter_size, BLOCK_M, BLOCK_K)
        w_lo, w_hi = _weight_tile(w_ptr, s_ptr, e, offs_n, mask_n, j0, half_k, stride_we,
                                  stride_wn, stride_se, stride_sn, BKH, dtype, MXFP4, LUT,
                                  table_h, table_l)
        acc = tl.dot(a_even, w_lo, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(a_odd, w_hi, acc, input_precision=DOT_PRECISION)
    o_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _gemv_x(row_ptr, k0, K, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr, LUT: tl.constexpr):
    """The activation chunk k0 .. k0 + BLOCK_K of one row, in fp32, shaped for _gemv_dot.
    MXFP4: (even K values [1, G, 16], odd K values [1, G, 16]), G = BLOCK_K / 32 scale groups,
    packed position j = 16 g + t holding K values 2j (low nibble) and 2j + 1 (high nibble), so
    the packed weight bytes need no interleave; times 2^63 (the other half of the bit decode's
    2^126) unless LUT. LUT (bf16 rows): each pair (2j, 2j + 1) is read as one 32-bit word and
    split into its two fp32 values by a shift and a mask, no strided 16-bit loads.
    Dense: (the chunk [1, BLOCK_K], the same)."""
    if MXFP4 and LUT:
        G: tl.constexpr = BLOCK_K // 32
        j = k0 // 2 + tl.arange(0, G)[:, None] * 16 + tl.arange(0, 16)[None, :]   # [G, 16]
        words = tl.load(row_ptr.to(tl.pointer_type(tl.int32)) + j, mask=j < K // 2, other=0)
        lo = (words << 16).to(tl.float32, bitcast=True)[None, :, :]
        hi = (words & -65536).to(tl.float32, bitcast=True)[None, :, :]
    elif MXFP4:   # times 2^63: the other half of the decode's 2^126 (_e2m1_pair_tiny)
        G: tl.constexpr = BLOCK_K // 32
        j = k0 // 2 + tl.arange(0, G)[:, None] * 16 + tl.arange(0, 16)[None, :]   # [G, 16]
        mask = j < K // 2
        lo = tl.load(row_ptr + 2 * j, mask=mask, other=0.0).to(tl.float32)[None, :, :]
        hi = tl.load(row_ptr + 2 * j + 1, mask=mask, other=0.0).to(tl.float32)[None, :, :]
        lo = lo * TWO_POW_63
        hi = hi * TWO_POW_63
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        lo = tl.load(row_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]  # [1, BK]
        hi = lo
    return lo, hi


@triton.jit
def _gemv_dot(w_ptr, s_ptr, offs_n, mask_n, k0, K, x_lo, x_hi, stride_wn, stride_sn,
              BLOCK_K: tl.constexpr, MXFP4: tl.constexpr, LUT: tl.constexpr, table_h=0,
              table_l=0):
    """The weight rows offs_n of one expert (w_ptr, s_ptr at the expert) against the
    activation chunk k0 .. k0 + BLOCK_K of _gemv_x, as fp32 partial sums the caller adds up
    elementwise over the K loop and reduces once after it (a cross-thread reduction every K
    step costs more instructions than the products). MXFP4: [BN, G], the
    packed bytes as [BN, G, 16] (contiguous along K, 16 to a thread), each group's sum times
    its E8M0 scale (an exact power of two, so the same value as scaling each decoded element,
    up to fp32 rounding); both nibbles decoded by _e2m1_pair_tiny against the even / odd
    activations (x 2^63: _gemv_x), or with LUT by _e2m1_pair_lut (exact values; table_h,
    table_l: LUT_TABLE_WORDS); each group's 32 products summed in one fma chain. Dense:
    [BN, BLOCK_K] products of a tile of an [N, K] weight (s_ptr unused)."""
    rows = offs_n.to(tl.int64)
    if MXFP4:
        G: tl.constexpr = BLOCK_K // 32
        offs_g = k0 // 32 + tl.arange(0, G)                                      # [G]
        mask_g = mask_n[:, None] & (offs_g < K // 32)[None, :]                   # [BN, G]
        j = offs_g[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]         # [1, G, 16]
        codes = tl.load(w_ptr + rows[:, None, None] * stride_wn + j,
                        mask=mask_g[:, :, None], other=0)                        # [BN, G, 16]
        scale = _e8m0(tl.load(s_ptr + rows[:, None] * stride_sn + offs_g[None, :],
                              mask=mask_g, other=127).to(tl.int32))              # [BN, G]
        if LUT:
            lo, hi = _e2m1_pair_lut(codes, table_h, table_l)
            acc = _pair_dot16(lo, hi, x_lo, x_hi) * scale
        else:
            lo, hi = _e2m1_pair_tiny(codes.to(tl.int32))                         # x 2^-126
            # x 2^-63, then exact, then the group scale
            acc = (_pair_dot16(lo, hi, x_lo, x_hi) * TWO_POW_63) * scale
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :],
                    mask=mask_n[:, None] & (k < K)[None, :], other=0.0)          # [BN, BK]
        acc = w.to(tl.float32) * x_lo
    return acc



@triton.jit
def _gemv_entry(topk_ids_ptr, num_experts, out_cols, BLOCK_N: tl.constexpr):
    """(routing entry r, its expert e (int64), the output columns offs_n, their mask, whether
    e is outside [0, E), i.e. nothing to do) of this program: the grid is (entries x column
    tiles), the column tiles of one entry consecutive (they share its activation row)."""
    num_pid_n = tl.cdiv(out_cols, BLOCK_N)
    r = (tl.program_id(0) // num_pid_n).to(tl.int64)
    offs_n = (tl.program_id(0) % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(topk_ids_ptr + r).to(tl.int64)
    return r, e, offs_n, offs_n < out_cols, (e < 0) | (e >= num_experts)


@triton.jit
def mxfp4_moe_gemv1_kernel(
    x_ptr, w_ptr, s_ptr, inter_ptr, topk_ids_ptr, table_ptr,
    inter_size, hidden, top_k, num_experts, beta, linear_beta,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_im,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr, CLIP_UP: tl.constexpr,
    MXFP4: tl.constexpr = True, USE_PDL: tl.constexpr = False, LUT: tl.constexpr = False,
):
    """mxfp4_moe_gemm1_kernel's math for one or a few tokens, without tl.dot (whose 16-row
    minimum pads 15 of 16 rows at one token): one program per (routing entry r = n * top_k + j,
    BLOCK_N columns of the intermediate), inter[r, cols] = act(W1_e[cols] x[n], W3_e[cols]
    x[n]) with e = topk_ids[r] (gate rows cols, up rows I + cols of w13). No alignment: the
    entry reads its token's row directly. Entries with ids outside [0, E) are left unwritten.
    Per BLOCK_K chunk the gate and up tiles reduce along K into fp32 [BLOCK_N] accumulators,
    so wide K chunks make a short loop and many small programs fill the SMs. LUT: the
    byte-permute decode (E2M1_LUT_ASM) with bf16 x read in (even, odd) pairs; table_ptr holds
    LUT_TABLE_WORDS (int32), read only then."""
    pdl_wait(USE_PDL)
    r, e, offs_n, mask_n, skip = _gemv_entry(topk_ids_ptr, num_experts, inter_size, BLOCK_N)
    if skip:
        return
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    x_row = x_ptr + (r // top_k) * stride_xm
    W: tl.constexpr = BLOCK_K // 32 if MXFP4 else BLOCK_K     # _gemv_dot's partial columns
    acc_g = tl.zeros([BLOCK_N, W], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, W], dtype=tl.float32)
    table_h, table_l = _lut_tables(table_ptr, LUT)
    for k0 in range(0, hidden, BLOCK_K):
        x_lo, x_hi = _gemv_x(x_row, k0, hidden, BLOCK_K, MXFP4, LUT)
        acc_g += _gemv_dot(w_e, s_e, offs_n, mask_n, k0, hidden, x_lo, x_hi, stride_wn,
                           stride_sn, BLOCK_K, MXFP4, LUT, table_h, table_l)
        acc_u += _gemv_dot(w_e, s_e, offs_n + inter_size, mask_n, k0, hidden, x_lo, x_hi,
                           stride_wn, stride_sn, BLOCK_K, MXFP4, LUT, table_h, table_l)
    h = _glu(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), beta, linear_beta, ACT, CLIP_UP)
    tl.store(inter_ptr + r * stride_im + offs_n, h.to(inter_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def mxfp4_moe_gemv2_kernel(
    inter_ptr, w_ptr, s_ptr, out_ptr, topk_ids_ptr, table_ptr,
    hidden, inter_size, num_experts,
    stride_im, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr = True,
    USE_PDL: tl.constexpr = False, LUT: tl.constexpr = False,
):
    """mxfp4_moe_gemm2_kernel's math in mxfp4_moe_gemv1_kernel's form: one program per
    (routing entry r, BLOCK_N columns of the latent), partial[r, cols] = W2_e[cols] inter[r],
    unweighted; entries with ids outside [0, E) left unwritten."""
    pdl_wait(USE_PDL)
    r, e, offs_n, mask_n, skip = _gemv_entry(topk_ids_ptr, num_experts, hidden, BLOCK_N)
    if skip:
        return
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    a_row = inter_ptr + r * stride_im
    W: tl.constexpr = BLOCK_K // 32 if MXFP4 else BLOCK_K     # _gemv_dot's partial columns
    acc = tl.zeros([BLOCK_N, W], dtype=tl.float32)
    table_h, table_l = _lut_tables(table_ptr, LUT)
    for k0 in range(0, inter_size, BLOCK_K):
        a_lo, a_hi = _gemv_x(a_row, k0, inter_size, BLOCK_K, MXFP4, LUT)
        acc += _gemv_dot(w_e, s_e, offs_n, mask_n, k0, inter_size, a_lo, a_hi, stride_wn,
                         stride_sn, BLOCK_K, MXFP4, LUT, table_h, table_l)
    tl.store(out_ptr + r * stride_om + offs_n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty),
             mask=mask_n)


@triton.jit(do_not_specialize=["num_tokens"])
def latent_moe_tail_kernel(
    partial_ptr, topk_weights_ptr, topk_ids_ptr, norm_ptr, up_ptr, residual_ptr, out_ptr,
    num_tokens, latent, hidden, num_experts, eps,
    stride_pm, stride_un, stride_rm, stride_om,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """out[n, cols] = r_n * ((sum_j w[n, j] * partial[n * top_k + j]) * g) @ W_up[cols]^T
    (+ residual[n, cols]); r_n = rsqrt(mean over the latent of the weighted sum^2 + eps), or 1
    without HAS_NORM (g = 1 then). Entries with ids outside [0, E) are skipped (never read).
    A 1-D grid over (row tile, column tile), the column tiles of one row tile consecutive, so
    the programs re-reading the same partials run close together (the re-reads can hit L2).
    TOP_K is the model's routing width: the loop over it unrolls, so its loads are independent
    and in flight together instead of one dependent load chain per chunk."""
    pdl_wait(USE_PDL)
    num_pid_n = tl.cdiv(hidden, BLOCK_N)
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < num_tokens
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    dtype = up_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, latent, BLOCK_K):
        cols = k0 + offs_k
        mask_k = cols < latent
        lat = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for j in range(0, TOP_K):
            r = offs_m.to(tl.int64) * TOP_K + j
            eid = tl.load(topk_ids_ptr + r, mask=mask_m, other=-1)
            ok = mask_m & (eid >= 0) & (eid < num_experts)
            w = tl.load(topk_weights_ptr + r, mask=ok, other=0.0).to(tl.float32)
            p = tl.load(partial_ptr + r[:, None] * stride_pm + cols[None, :],
                        mask=ok[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            lat += w[:, None] * p
        sq += tl.sum(lat * lat, axis=1)
        if HAS_NORM:
            lat = lat * tl.load(norm_ptr + cols, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        up = tl.load(up_ptr + offs_n[None, :].to(tl.int64) * stride_un + cols[:, None],
                     mask=mask_k[:, None] & mask_n[None, :], other=0.0)       # [BK, BN]
        acc = tl.dot(lat.to(dtype), up, acc, input_precision=DOT_PRECISION)
    if HAS_NORM:
        acc = acc * tl.rsqrt(sq / latent + eps)[:, None]
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + offs_m[:, None].to(tl.int64) * stride_rm + offs_n[None, :],
                       mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def latent_moe_tail_gemv_kernel(
    partial_ptr, topk_weights_ptr, topk_ids_ptr, norm_ptr, up_ptr, residual_ptr, out_ptr,
    latent, hidden, num_experts, eps,
    stride_pm, stride_un, stride_rm, stride_om,
    TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """latent_moe_tail_kernel's math for a few tokens (decode): one program per (token, column
    tile), no tl.dot (whose 16-row minimum would waste 15 of 16 rows at one token), so the
    grid has hidden / BLOCK_N programs per token and the up weight streams through every SM.
    Per latent chunk: the token's top-k partial rows as one [TOP_K_P2, BLOCK_K] load, their
    weighted sum, then a [BLOCK_N, BLOCK_K] weight tile reduced along K (fp32 throughout).
    Each program recomputes the weighted sum of its token (re-read from L2: top_k * latent
    values a program, against BLOCK_N * latent weight values)."""
    pdl_wait(USE_PDL)
    num_pid_n = tl.cdiv(hidden, BLOCK_N)
    row = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    offs_j = tl.arange(0, TOP_K_P2)
    r = row.to(tl.int64) * TOP_K + offs_j                                     # [TOP_K_P2]
    eid = tl.load(topk_ids_ptr + r, mask=offs_j < TOP_K, other=-1)
    ok = (offs_j < TOP_K) & (eid >= 0) & (eid < num_experts)
    w = tl.load(topk_weights_ptr + r, mask=ok, other=0.0).to(tl.float32)     # [TOP_K_P2]
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, latent, BLOCK_K):
        cols = k0 + offs_k
        mask_k = cols < latent
        p = tl.load(partial_ptr + r[:, None] * stride_pm + cols[None, :],
                    mask=ok[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        lat = tl.sum(w[:, None] * p, axis=0)                                  # [BLOCK_K]
        sq += lat * lat
        if HAS_NORM:
            lat = lat * tl.load(norm_ptr + cols, mask=mask_k, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + offs_n[:, None].to(tl.int64) * stride_un + cols[None, :],
                     mask=mask_n[:, None] & mask_k[None, :], other=0.0)       # [BN, BK]
        acc += tl.sum(up.to(tl.float32) * lat[None, :], axis=1)
    if HAS_NORM:
        acc = acc * tl.rsqrt(tl.sum(sq, axis=0) / latent + eps)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + row.to(tl.int64) * stride_rm + offs_n, mask=mask_n,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + offs_n,
             acc.to(out_ptr.dtype.element_ty), mask=mask_n)
