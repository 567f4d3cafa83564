"""Triton kernels of the gated activations: SiTU over a merged gate|up row, sigmoid gating."""

import triton
import triton.language as tl


@triton.jit
def _tanh(z):
    e = tl.exp(-2.0 * tl.abs(z))                 # in (0, 1]: no overflow
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z >= 0, t, -t)


@triton.jit
def situ_and_mul_kernel(x_ptr, out_ptr, inter, beta, linear_beta, stride_x, stride_o,
                        CLIP_UP: tl.constexpr, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    """Program (row, column block): x row = [gate (inter) | up (inter)];
    out = beta * tanh(gate / beta) * sigmoid(gate) * up', up' = linear_beta * tanh(up /
    linear_beta) when CLIP_UP else up; fp32, rounded once to out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    if CLIP_UP:
        u = linear_beta * _tanh(u / linear_beta)
    y = beta * _tanh(g / beta) * tl.sigmoid(g) * u
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sigmoid_gate_kernel(x_ptr, g_ptr, n, stride_x, stride_g, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    """Program (row, column block): x *= sigmoid(g) in place (fp32, rounded once to x's
    dtype)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    y = x.to(tl.float32) * tl.sigmoid(g)
    tl.store(x_ptr + row * stride_x + offs, y.to(x.dtype), mask=mask)
