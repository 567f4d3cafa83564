"""Triton kernels for RMS norms (one program per row)."""

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, out32_ptr, D, eps,
                        stride_x, stride_res, stride_out, stride_res_out, stride_out32,
                        HAS_RESIDUAL: tl.constexpr, OUT32: tl.constexpr, BLOCK_D: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    """One program per row. USE_PDL (programmatic dependent launch): only the norm weight is
    read before griddepcontrol.wait; x, residual and every store come after it."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    if USE_PDL:   # the weight is immutable: load it while the previous kernel finishes
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)   # the residual stream's rounding
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / D
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    if not USE_PDL:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * stride_out + offs, y, mask=mask)
    if OUT32:   # the same values widened: an fp32 GEMM's input without a separate cast
        tl.store(out32_ptr + row * stride_out32 + offs, y.to(tl.float32), mask=mask)


@triton.jit(do_not_specialize=["N"])
def rms_norm_gated_kernel(x_ptr, g_ptr, w_ptr, out_ptr, N, D, eps, stride_x, stride_g,
                          stride_out, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          USE_PDL: tl.constexpr = False):
    """BLOCK_N rows per program (KDA's output norm runs over T * H rows of one head dim: a
    program per 128-element row would spend its time being scheduled). USE_PDL (programmatic
    dependent launch): only the norm weight is read before griddepcontrol.wait; x, the gate and
    the store come after it."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = tl.arange(0, BLOCK_D)
    mask_d = offs < D
    mask = (rows < N)[:, None] & mask_d[None, :]
    if USE_PDL:   # the weight is immutable: load it while the previous kernel finishes
        w = tl.load(w_ptr + offs, mask=mask_d, other=0.0).to(tl.float32)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask,
                other=0.0).to(tl.float32)                                       # [BN, BD]
    g = tl.load(g_ptr + rows[:, None] * stride_g + offs[None, :], mask=mask,
                other=0.0).to(tl.float32)
    if not USE_PDL:
        w = tl.load(w_ptr + offs, mask=mask_d, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=1) / D                                             # [BN]
    y = x * tl.rsqrt(var + eps)[:, None] * w[None, :] * tl.sigmoid(g)
    tl.store(out_ptr + rows[:, None] * stride_out + offs[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)
