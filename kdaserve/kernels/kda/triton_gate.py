"""Triton kernel of KDA's bounded decay gate and beta (Kimi K3), one launch for both."""

import triton
import triton.language as tl


@triton.jit
def kda_gate_beta_kernel(g_ptr, a_log_ptr, dt_bias_ptr, b_ptr, g_out_ptr, beta_out_ptr,
                         HK, K, H, lower_bound, stride_g, stride_b, stride_go, stride_bo,
                         BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    """Program (row, column block) over the row's H * K gate channels c (head c // K):
    g_out = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[c])) in fp32; column block 0
    also writes beta_out = sigmoid(b) for the row's H heads. USE_PDL: A_log and dt_bias are
    read before griddepcontrol.wait."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1)
    offs = col * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HK
    head = offs // K
    if USE_PDL:
        a = tl.exp(tl.load(a_log_ptr + head, mask=mask, other=0.0).to(tl.float32))
        dt = tl.load(dt_bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    else:
        a = tl.exp(tl.load(a_log_ptr + head, mask=mask, other=0.0).to(tl.float32))
        dt = tl.load(dt_bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    out = lower_bound * tl.sigmoid(a * (g + dt))
    tl.store(g_out_ptr + row * stride_go + offs, out, mask=mask)
    if col == 0:
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        b = tl.load(b_ptr + row * stride_b + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        tl.store(beta_out_ptr + row * stride_bo + offs_h, tl.sigmoid(b), mask=mask_h)
