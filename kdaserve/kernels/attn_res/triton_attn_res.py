"""Triton kernel of one AttnRes read (one program per token row)."""

import triton
import triton.language as tl


@triton.jit
def _source_logit(x, wq, D, eps):
    """logit of one source row x [BLOCK_D] fp32: (x * rsqrt(mean(x^2) + eps)) . wq, with
    wq = norm_weight * query (fp32)."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    return tl.sum(x * wq, axis=0) * rstd


@triton.jit(do_not_specialize=["write_idx"])
def attn_res_kernel(prefix_ptr, delta_ptr, blocks_ptr, norm_w_ptr, query_ptr, out_norm_w_ptr,
                    prefix_out_ptr, out_ptr, D, write_idx, eps,
                    stride_p, stride_d, stride_bt, stride_bb, stride_po, stride_o,
                    NUM_BLOCKS: tl.constexpr, HAS_DELTA: tl.constexpr, WRITE: tl.constexpr,
                    HAS_OUT_NORM: tl.constexpr,
                    BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Row t: p = prefix + delta (rounded to the prefix dtype, stored to prefix_out when
    HAS_DELTA, and to blocks[t, write_idx] when WRITE); sources blocks[t, :num_blocks] and p;
    an online softmax over their logits (_source_logit) mixes the raw sources in fp32; the
    mixture, rounded to the prefix dtype, is RMS-normed by out_norm_w (HF numerics: normalised
    in fp32, rounded, times the weight) when HAS_OUT_NORM. The caller guarantees write_idx is
    not below NUM_BLOCKS (no source is the block this program writes). USE_PDL: only the
    three weights are read before griddepcontrol.wait."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    if USE_PDL:   # the weights are immutable: load them while the previous kernel finishes
        nw = tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        qw = tl.load(query_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_OUT_NORM:
            ow = tl.load(out_norm_w_ptr + offs, mask=mask, other=0.0)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    else:
        nw = tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        qw = tl.load(query_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_OUT_NORM:
            ow = tl.load(out_norm_w_ptr + offs, mask=mask, other=0.0)
    wq = nw * qw
    p = tl.load(prefix_ptr + row * stride_p + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0)
        p = (p.to(tl.float32) + d.to(tl.float32)).to(p.dtype)   # the prefix's own rounding
        tl.store(prefix_out_ptr + row * stride_po + offs, p, mask=mask)
    b_row = blocks_ptr + row * stride_bt
    if WRITE:
        tl.store(b_row + write_idx * stride_bb + offs, p.to(blocks_ptr.dtype.element_ty),
                 mask=mask)
    # online softmax, started from the prefix source (weight exp(0) = 1)
    acc = p.to(tl.float32)
    m = _source_logit(acc, wq, D, eps)
    denom = m * 0.0 + 1.0
    for s in tl.static_range(NUM_BLOCKS):   # a layer's count: unrolled, one variant each
        x = tl.load(b_row + s * stride_bb + offs, mask=mask, other=0.0).to(tl.float32)
        logit = _source_logit(x, wq, D, eps)
        m_new = tl.maximum(m, logit)
        alpha = tl.exp(m - m_new)
        e = tl.exp(logit - m_new)
        acc = acc * alpha + e * x
        denom = denom * alpha + e
        m = m_new
    mixed = (acc / denom).to(p.dtype)
    if HAS_OUT_NORM:
        xf = mixed.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
        normed = (xf * rstd).to(p.dtype)
        y = (ow.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    else:
        y = mixed.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)
