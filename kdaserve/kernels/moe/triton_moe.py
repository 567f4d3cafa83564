"""Triton kernels of the fused MoE layer (imported lazily by fused_moe.py).

Routing entries are the flattened top-k pairs: entry r = n * top_k + j is token n's j-th expert.
  (moe_align_small_kernel does steps 1-3 in one program, without atomics, for decode batches)
  1. moe_count_kernel     counts[e] = #entries routed to e                        (atomics)
  2. moe_offsets_kernel   expert_start[e] (padded to BLOCK_M), block -> expert map, total rows
  3. moe_scatter_kernel   sorted_ids[expert_start[e] + rank] = r                  (atomics)
  4. moe_gemm1_kernel     inter[r] = silu(x[n] @ w_gate[e]^T) * (x[n] @ w_up[e]^T)
  5. moe_gemm2_kernel     buf[r] = topk_weight[r] * (inter[r] @ w2[e]^T)
  6. moe_sum_kernel       out[n] = sum_j buf[n * top_k + j]
One token (N = 1): moe_gemm2_sum_kernel does steps 5 and 6 in one launch (a GEMV over k * I).
Entries whose expert id is outside [0, E) are dropped (expert-parallel "not local" convention).
On the atomic path the order of rows inside an expert's block depends on atomics (the one-program
path keeps entry order), but each row's result does not (GEMM rows are independent and step 6 sums
in a fixed order), so the output is deterministic either way.

USE_PDL (every kernel; programmatic dependent launch, sm_90+): griddepcontrol.wait comes before
the kernel's first load, then griddepcontrol.launch_dependents. Every input here is either
written by the previous kernels (routing ids, alignment, activations) or addressed through them
(expert weights): nothing is read early; the gain is the overlapped launch. USE_PDL=False
generates the same code as before the flag existed.
"""

import triton
import triton.language as tl

from kdaserve.kernels.triton_pdl import pdl_wait


# The alignment kernels (count, offsets, align_small, scatter) move a few hundred bytes: their
# pointers are not specialised on 16-byte alignment (do_not_specialize_on_alignment), so a step
# whose routing tensors sit at another offset reuses the warm-up's build instead of compiling.


@triton.jit(do_not_specialize=["numel"],
            do_not_specialize_on_alignment=["topk_ids_ptr", "counts_ptr"])
def moe_count_kernel(topk_ids_ptr, counts_ptr, numel, num_experts, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(topk_ids_ptr + offs, mask=offs < numel, other=-1)
    ok = (offs < numel) & (e >= 0) & (e < num_experts)
    tl.atomic_add(counts_ptr + e, tl.full([BLOCK], 1, tl.int32), mask=ok)


@triton.jit
def _expert_offsets(counts, mask_e, expert_start_ptr, expert_ids_ptr, num_rows_ptr, max_blocks,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pad each expert's count to BLOCK_M; store starts, the total and the block -> expert map.
    Returns start [BLOCK_E] (first padded row of each expert).

    The map is scattered, not searched: for j below the largest per-expert block count, every
    expert with more than j blocks writes its id into block first[e] + j (one [BLOCK_E] store per
    j, so decode, where an expert has one or two blocks, loops once or twice); blocks from the
    total up to max_blocks get -1."""
    offs_e = tl.arange(0, BLOCK_E)
    nblk = tl.cdiv(counts, BLOCK_M)                                    # [BLOCK_E] blocks per expert
    first = tl.cumsum(nblk, axis=0) - nblk                            # [BLOCK_E] exclusive
    start = first * BLOCK_M
    tl.store(expert_start_ptr + offs_e, start, mask=mask_e)
    used = tl.sum(nblk, axis=0)
    tl.store(num_rows_ptr, used * BLOCK_M)
    for j in range(0, tl.max(nblk, axis=0)):
        tl.store(expert_ids_ptr + first + j, offs_e, mask=mask_e & (j < nblk))
    for b0 in range(used, max_blocks, BLOCK_E):
        offs_b = b0 + offs_e
        tl.store(expert_ids_ptr + offs_b, tl.full([BLOCK_E], -1, tl.int32),
                 mask=offs_b < max_blocks)
    return start


@triton.jit(do_not_specialize=["max_blocks"],
            do_not_specialize_on_alignment=["counts_ptr", "expert_start_ptr", "cursor_ptr",
                                            "expert_ids_ptr", "num_rows_ptr"])
def moe_offsets_kernel(counts_ptr, expert_start_ptr, cursor_ptr, expert_ids_ptr, num_rows_ptr,
                       num_experts, max_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < num_experts
    counts = tl.load(counts_ptr + offs_e, mask=mask_e, other=0)
    start = _expert_offsets(counts, mask_e, expert_start_ptr, expert_ids_ptr, num_rows_ptr,
                            max_blocks, BLOCK_M, BLOCK_E)
    tl.store(cursor_ptr + offs_e, start, mask=mask_e)


@triton.jit
def _load_experts(topk_ids_ptr, offs, numel, num_experts):
    """(expert id as int32, -1 where dropped; routed mask) of the entries at offs."""
    e = tl.load(topk_ids_ptr + offs, mask=offs < numel, other=-1)
    ok = (offs < numel) & (e >= 0) & (e < num_experts)
    return tl.where(ok, e, -1).to(tl.int32), ok


@triton.jit(do_not_specialize=["numel", "max_blocks"],   # both follow the step's token count
            do_not_specialize_on_alignment=["topk_ids_ptr", "counts_ptr", "expert_start_ptr",
                                            "expert_ids_ptr", "num_rows_ptr", "sorted_ids_ptr"])
def moe_align_small_kernel(topk_ids_ptr, counts_ptr, expert_start_ptr, expert_ids_ptr,
                           num_rows_ptr, sorted_ids_ptr, numel, num_experts, max_blocks,
                           BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
    """Steps 1-3 in one program for numel <= BLOCK_T entries (decode), no atomics; an expert's
    entries sit in entry order. counts = histogram of the entries; then one sort of the keys
    e * BLOCK_T + r (dropped entries last) lists the entries grouped by expert, in entry order
    within one: sorted position p of expert e goes to padded row start[e] + p - first[e], where
    first[e] is the number of routed entries of the experts before e."""
    pdl_wait(USE_PDL)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < num_experts
    offs = tl.arange(0, BLOCK_T)
    e, ok = _load_experts(topk_ids_ptr, offs, numel, num_experts)
    counts = tl.histogram(e, BLOCK_E, mask=ok)                         # [BLOCK_E]
    tl.store(counts_ptr + offs_e, counts, mask=mask_e)
    start = _expert_offsets(counts, mask_e, expert_start_ptr, expert_ids_ptr, num_rows_ptr,
                            max_blocks, BLOCK_M, BLOCK_E)
    shift = start - (tl.cumsum(counts, axis=0) - counts)              # [BLOCK_E] start - first
    key = tl.sort(tl.where(ok, e, BLOCK_E) * BLOCK_T + offs)           # [BLOCK_T] ascending
    e_p = key // BLOCK_T
    valid = e_p < num_experts
    row = tl.gather(shift, tl.where(valid, e_p, 0), 0) + offs         # [BLOCK_T]
    tl.store(sorted_ids_ptr + row, key % BLOCK_T, mask=valid)


@triton.jit(do_not_specialize=["numel"],
            do_not_specialize_on_alignment=["topk_ids_ptr", "cursor_ptr", "sorted_ids_ptr"])
def moe_scatter_kernel(topk_ids_ptr, cursor_ptr, sorted_ids_ptr, numel, num_experts,
                       BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(topk_ids_ptr + offs, mask=offs < numel, other=-1)
    ok = (offs < numel) & (e >= 0) & (e < num_experts)
    pos = tl.atomic_add(cursor_ptr + e, tl.full([BLOCK], 1, tl.int32), mask=ok)
    tl.store(sorted_ids_ptr + pos, offs, mask=ok)


@triton.jit
def _block_rows(pid_m, sorted_ids_ptr, expert_ids_ptr, expert_start_ptr, counts_ptr,
                num_experts, BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
    """(expert, entry ids [BLOCK_M], valid mask [BLOCK_M]) of one padded row block.

    DIRECT (one token, so every entry has its own expert): block i is entry i alone, its expert
    read straight from topk_ids (passed as expert_ids_ptr); no alignment pass is needed."""
    if DIRECT:
        e = tl.load(expert_ids_ptr + pid_m)
        offs = tl.arange(0, BLOCK_M)
        valid = (offs == 0) & (e >= 0) & (e < num_experts)
        rows = tl.zeros([BLOCK_M], dtype=tl.int64) + pid_m
        return tl.maximum(e, 0).to(tl.int64), rows, valid
    e = tl.load(expert_ids_ptr + pid_m)
    e_safe = tl.maximum(e, 0)
    start = tl.load(expert_start_ptr + e_safe)
    count = tl.load(counts_ptr + e_safe)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = (offs_m - start < count) & (e >= 0)
    rows = tl.load(sorted_ids_ptr + offs_m, mask=valid, other=0)
    return e_safe.to(tl.int64), rows.to(tl.int64), valid


@triton.jit
def _grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Walk GROUP_M row blocks before moving along N, so weight tiles are reused from L2."""
    group_size = GROUP_M * num_pid_n
    group_id = pid // group_size
    first_m = group_id * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % size_m
    pid_n = (pid % group_size) // size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["max_blocks"])
def moe_gemm1_kernel(
    x_ptr, w13_ptr, inter_ptr,
    sorted_ids_ptr, expert_ids_ptr, expert_start_ptr, counts_ptr, num_rows_ptr,
    inter_size, hidden, top_k, max_blocks, num_experts,
    stride_xm, stride_we, stride_wn, stride_wk, stride_im,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr = False,
    EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    W_DESC: tl.constexpr = False,
):
    """EVEN_K / EVEN_N: hidden is a multiple of BLOCK_K / inter_size of BLOCK_N, so the weight
    loads need no mask (the activation rows keep theirs). W_DESC: w13_ptr is a tensor
    descriptor of w13 as [E * 2I, D] with [BLOCK_N, BLOCK_K] blocks (fused_moe's
    MoEGemmConfig.tma_weights): the weight tiles come by TMA into shared memory, the K tail and
    the rows past the last expert as zeros; a tile's rows past its expert's gate or up half
    are read from the next rows and only feed columns that are not stored."""
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
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]                     # [BM, BK]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if W_DESC:
        row_g = (e * 2 * inter_size + pid_n * BLOCK_N).to(tl.int32)   # gate rows of the tile
        for k0 in range(0, hidden, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k < hidden - k0)[None, :],
                            other=0.0)
            wg = w13_ptr.load([row_g, k0])                                   # [BN, BK]
            wu = w13_ptr.load([row_g + inter_size, k0])
            acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
    else:
        g_ptrs = (w13_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
                  + offs_k[:, None] * stride_wk)                                     # [BK, BN]
        u_ptrs = g_ptrs + inter_size * stride_wn
        for k0 in range(0, hidden, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                if EVEN_N:
                    wg = tl.load(g_ptrs)
                    wu = tl.load(u_ptrs)
                else:
                    wg = tl.load(g_ptrs, mask=mask_n[None, :], other=0.0)
                    wu = tl.load(u_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                mask_k = offs_k < hidden - k0
                a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u                                        # SwiGLU
    o_ptrs = inter_ptr + rows[:, None] * stride_im + offs_n[None, :]
    tl.store(o_ptrs, h.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["max_blocks"])
def moe_gemm2_kernel(
    inter_ptr, w2_ptr, buf_ptr, topk_weights_ptr,
    sorted_ids_ptr, expert_ids_ptr, expert_start_ptr, counts_ptr, num_rows_ptr,
    hidden, inter_size, max_blocks, num_experts,
    stride_im, stride_we, stride_wn, stride_wk, stride_bm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr = False,
    EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    W_DESC: tl.constexpr = False,
):
    """EVEN_K / EVEN_N: inter_size is a multiple of BLOCK_K / hidden of BLOCK_N (unmasked
    weight loads). W_DESC: w2_ptr is a tensor descriptor of w2 as [E * D, I] with [BLOCK_N,
    BLOCK_K] blocks (TMA; moe_gemm1_kernel's W_DESC)."""
    pdl_wait(USE_PDL)
    pid_m, pid_n = _grouped_pid(tl.program_id(0), max_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if not DIRECT:
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
    e, rows, valid = _block_rows(pid_m, sorted_ids_ptr, expert_ids_ptr, expert_start_ptr,
                                 counts_ptr, num_experts, BLOCK_M, DIRECT)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + rows[:, None] * stride_im + offs_k[None, :]                 # [BM, BK]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if W_DESC:
        row_w = (e * hidden + pid_n * BLOCK_N).to(tl.int32)
        for k0 in range(0, inter_size, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k < inter_size - k0)[None, :],
                            other=0.0)
            w = w2_ptr.load([row_w, k0])                                     # [BN, BK]
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
    else:
        w_ptrs = (w2_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
                  + offs_k[:, None] * stride_wk)                                     # [BK, BN]
        for k0 in range(0, inter_size, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                if EVEN_N:
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                mask_k = offs_k < inter_size - k0
                a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
    route_w = tl.load(topk_weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    acc = acc * route_w[:, None]
    o_ptrs = buf_ptr + rows[:, None] * stride_bm + offs_n[None, :]
    tl.store(o_ptrs, acc.to(buf_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit
def moe_sum_kernel(buf_ptr, topk_ids_ptr, out_ptr, hidden, num_experts, top_k,
                   stride_bm, stride_om, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    n = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < hidden
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(0, top_k):
        r = n * top_k + j
        e = tl.load(topk_ids_ptr + r)
        ok = (e >= 0) & (e < num_experts)
        acc += tl.load(buf_ptr + r * stride_bm + offs_d, mask=mask_d & ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * stride_om + offs_d, acc.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def moe_gemm2_sum_kernel(
    inter_ptr, w2_ptr, out_ptr, topk_weights_ptr, topk_ids_ptr,
    hidden, inter_size, top_k, num_experts,
    stride_im, stride_we, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """One token: out[0, cols] = sum_j route_w[j] * w2[e_j, cols, :] @ inter[j] (steps 5 + 6).

    A GEMV over a virtual K = top_k * inter_size. Program p owns output columns
    [p*BLOCK_N, +BLOCK_N) and walks one flat loop over (entry j, BLOCK_K chunk of inter_size) in a
    fixed order: deterministic, no atomics, no [k, D] buffer. The loop is a tl.range with
    num_stages=NUM_STAGES; in the sm_90 PTX that pipelines (cp.async) only the per-entry scalar
    loads (expert id, routing weight), not the weight tiles: Triton 3.6 does not pipeline loads
    that feed no tl.dot, so one [BLOCK_N, BLOCK_K] tile per program is in flight at a time.
    w2 tiles are [BLOCK_N, BLOCK_K], contiguous along inter_size. The routing weight scales the
    [BLOCK_K] activation chunk in fp32; products accumulate elementwise in a [BLOCK_N, BLOCK_K]
    fp32 tile, reduced over K once after the loop. No tl.dot, so fp32 operands work too.
    Entries with ids outside [0, E) contribute nothing (their loads are masked off).
    Steps 5 + 6 round each weighted expert output to buf's dtype before summing; here the sum
    stays in fp32 and is rounded once, into out's dtype."""
    pdl_wait(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    chunks = tl.cdiv(inter_size, BLOCK_K)
    row_offs = offs_n[:, None].to(tl.int64) * stride_wn                             # [BN, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for t in tl.range(0, top_k * chunks, num_stages=NUM_STAGES):
        j = t // chunks
        k0 = (t - j * chunks) * BLOCK_K
        e = tl.load(topk_ids_ptr + j).to(tl.int64)
        valid = (e >= 0) & (e < num_experts)
        e = tl.where(valid, e, 0)
        route_w = tl.load(topk_weights_ptr + j, mask=valid, other=0.0).to(tl.float32)
        mask_k = offs_k < inter_size - k0
        a = tl.load(inter_ptr + j * stride_im + k0 + offs_k, mask=mask_k & valid, other=0.0)
        a = a.to(tl.float32) * route_w                                               # [BK]
        w_ptrs = w2_ptr + e * stride_we + row_offs + (k0 + offs_k)[None, :]          # [BN, BK]
        w = tl.load(w_ptrs, mask=(mask_n[:, None] & mask_k[None, :]) & valid, other=0.0)
        acc += w.to(tl.float32) * a[None, :]
    y = tl.sum(acc, axis=1)                                                          # [BN]
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask_n)
