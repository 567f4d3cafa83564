"""Triton kernels of the sigmoid top-k router: the split-K logits GEMV and the top-k (imported
lazily by router.py)."""

import triton
import triton.language as tl


@triton.jit
def _route_row(logits, mask_e, offs_e, bias_ptr, bias, weights_ptr, ids_ptr, row, scaling,
               TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK_K: tl.constexpr, EXTRA_ID: tl.constexpr, BIAS_LOADED: tl.constexpr):
    """One token's routing from its logits [BLOCK_E]: sigmoid, selection bias, TOP_K rounds of
    argmax, renormalise, scale; stores TOP_K (weight, id) pairs (+ the extra column).
    BIAS_LOADED: `bias` holds the [BLOCK_E] selection bias already loaded (else it is unused and
    the bias is loaded from bias_ptr here)."""
    scores = tl.sigmoid(logits.to(tl.float32))                      # [BLOCK_E]
    select = scores
    if HAS_BIAS:
        if not BIAS_LOADED:
            bias = tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0)
        select += bias.to(tl.float32)
    select = tl.where(mask_e, select, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    w_row = tl.zeros([BLOCK_K], dtype=tl.float32)
    id_row = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):                                # k rounds of argmax
        best = tl.argmax(select, axis=0)
        hit = offs_e == best
        w = tl.sum(tl.where(hit, scores, 0.0), axis=0)
        w_row = tl.where(offs_k == j, w, w_row)
        id_row = tl.where(offs_k == j, best.to(tl.int32), id_row)
        select = tl.where(hit, float("-inf"), select)
    if RENORMALIZE:
        w_row = w_row / (tl.sum(w_row, axis=0) + 1e-20)
    w_row = w_row * scaling
    OUT_K: tl.constexpr = TOP_K + 1 if EXTRA_ID >= 0 else TOP_K
    if EXTRA_ID >= 0:
        extra = offs_k == TOP_K
        w_row = tl.where(extra, 1.0, w_row)
        id_row = tl.where(extra, EXTRA_ID, id_row)
    out_mask = offs_k < OUT_K
    tl.store(weights_ptr + row * OUT_K + offs_k, w_row, mask=out_mask)
    tl.store(ids_ptr + row * OUT_K + offs_k, id_row.to(ids_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def topk_sigmoid_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, stride_lt,
                        stride_part, scaling,
                        TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        EXTRA_ID: tl.constexpr = -1, NUM_PARTIALS: tl.constexpr = 1,
                        USE_PDL: tl.constexpr = False):
    """One token per program: TOP_K (weight, id) pairs; with EXTRA_ID >= 0 one more column
    (weight 1, id EXTRA_ID) follows: the shared expert folded into the routed ones.

    NUM_PARTIALS > 1: the logits are the sum of NUM_PARTIALS split-K partial rows (partial p of
    the token at logits_ptr + p * stride_part + row * stride_lt), added in fp32 in the fixed
    order 0, 1, ..., NUM_PARTIALS - 1 (deterministic); NUM_PARTIALS == 1 reads one row as is.

    One row per program keeps every reduction inside one or two warps: the 2-D [tokens,
    experts] tile this replaced spent ~25 us per decode step on cross-warp argmax rounds.

    USE_PDL (programmatic dependent launch): only the selection bias (immutable) is read before
    griddepcontrol.wait; the logits / partials and every store come after it."""
    row = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < num_experts
    bias = 0.0                                  # unused unless USE_PDL loads it here
    if USE_PDL:
        if HAS_BIAS:   # the bias is immutable: load it while the previous kernel finishes
            bias = tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0)
        tl.extra.cuda.gdc_wait()                  # the previous kernel's writes are visible
        tl.extra.cuda.gdc_launch_dependents()     # the next PDL kernel may start its preamble
    logits = tl.load(logits_ptr + row * stride_lt + offs_e, mask=mask_e, other=0.0)
    if NUM_PARTIALS > 1:
        logits = logits.to(tl.float32)                              # [BLOCK_E]
        for p in tl.static_range(1, NUM_PARTIALS):                  # fixed order: 0, 1, ...
            part_ptrs = logits_ptr + p * stride_part + row * stride_lt + offs_e
            logits += tl.load(part_ptrs, mask=mask_e, other=0.0).to(tl.float32)
    _route_row(logits, mask_e, offs_e, bias_ptr, bias, weights_ptr, ids_ptr, row, scaling,
               TOP_K, RENORMALIZE, HAS_BIAS, BLOCK_K, EXTRA_ID, USE_PDL)


@triton.jit
def router_logits_splitk_kernel(x_ptr, w_ptr, part_ptr, num_tokens, num_experts, hidden,
                                stride_xn, stride_we, stride_ps,
                                K_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                                EVEN_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Program (pe, s): partials[s, n, e] = sum of x[n, k] * w[e, k] over the K slice
    [s * K_PER_SPLIT, (s + 1) * K_PER_SPLIT) for every token n < num_tokens (<= BLOCK_N) and
    the experts e of block pe; exact fp32 (x read as fp32 whatever its dtype).

    The product is tl.dot with input_precision="ieee": fp32 operands without TF32 never reach
    the tensor cores, so Triton lowers it to CUDA-core FMAs, one sequential chain per output
    element over k (acc = fma(x[n, k], w[e, k], acc), k ascending, acc carried across the
    BLOCK_K chunks). A token's partial therefore depends only on its own x row and on
    K_PER_SPLIT, never on BLOCK_N, BLOCK_E or the other tokens: the batch invariance of the
    router. (A broadcast-multiply + tl.sum would reduce k in a tree whose shape follows the
    register layout, which the compiler picks from the whole tile, BLOCK_N included.) Checked
    on Triton 3.6's sm_90 PTX: one dependent fma.rn.f32 chain per element. The dot keeps no
    [BLOCK_N, BLOCK_E, BLOCK_K] product in registers: at BLOCK_N 64, BLOCK_E 32, BLOCK_K 32,
    4 warps ptxas reports 96 registers (118 for bf16 x), no spills; the loads of every chunk
    are cp.async-pipelined through shared memory (num_stages from the wrapper).
    Token rows past num_tokens read row num_tokens - 1 (clamped: no mask) and are not stored;
    expert rows past num_experts likewise. With EVEN_K (hidden % K_PER_SPLIT == 0) no K mask;
    otherwise k >= hidden reads 0, and fma(0, 0, acc) == acc keeps the chain exact.
    USE_PDL (programmatic dependent launch): griddepcontrol.wait before any load (the weight
    chunks are cp.async-pipelined with x's, so none is hoisted above the wait), then
    griddepcontrol.launch_dependents.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pe = tl.program_id(0)
    s = tl.program_id(1)
    offs_n = tl.arange(0, BLOCK_N)                                   # [BLOCK_N]
    offs_e = pe * BLOCK_E + tl.arange(0, BLOCK_E)                    # [BLOCK_E]
    offs_k = tl.arange(0, BLOCK_K)                                   # [BLOCK_K]
    rows_n = tl.minimum(offs_n, num_tokens - 1).to(tl.int64)
    rows_e = tl.minimum(offs_e, num_experts - 1).to(tl.int64)
    k_lo = s * K_PER_SPLIT
    x_ptrs = x_ptr + rows_n[:, None] * stride_xn + (k_lo + offs_k)[None, :]  # [BLOCK_N, BLOCK_K]
    w_ptrs = w_ptr + rows_e[:, None] * stride_we + (k_lo + offs_k)[None, :]  # [BLOCK_E, BLOCK_K]
    acc = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):                       # constexpr trip count
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = (k_lo + k0 + offs_k) < hidden                   # [BLOCK_K]
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                     input_precision="ieee")                         # [BLOCK_N, BLOCK_E]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = part_ptr + s * stride_ps + offs_n[:, None] * num_experts + offs_e[None, :]
    mask = (offs_n[:, None] < num_tokens) & (offs_e[None, :] < num_experts)
    tl.store(out_ptrs, acc.to(part_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _logits_chunk(acc, x_ptrs, w, k0, offs_k, n_mask, hidden, EVEN_K: tl.constexpr):
    """acc[n, e, k] += x[n, k0 + k] * w[e, k] (fp32) for one [BLOCK_E, BLOCK_K] weight chunk w;
    token rows past num_tokens (n_mask [BLOCK_N, 1] false) and k >= hidden read 0."""
    if EVEN_K:
        x = tl.load(x_ptrs + k0, mask=n_mask, other=0.0)             # [BLOCK_N, BLOCK_K]
    else:
        k_ok = ((k0 + offs_k) < hidden)[None, :]
        x = tl.load(x_ptrs + k0, mask=n_mask & k_ok, other=0.0)
    return acc + x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]


@triton.jit
def _weight_chunk(w_ptrs, k0, offs_k, hidden, EVEN_K: tl.constexpr):
    """The [BLOCK_E, BLOCK_K] weight chunk at K offset k0 (zeros past hidden)."""
    if EVEN_K:
        w = tl.load(w_ptrs + k0)
    else:
        w = tl.load(w_ptrs + k0, mask=((k0 + offs_k) < hidden)[None, :], other=0.0)
    return w


@triton.jit
def _route_all_rows(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, num_experts,
                    scaling, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_OUT: tl.constexpr,
                    EXTRA_ID: tl.constexpr):
    """The last program's tail: every token's logits row [E] back from the scratch through L2
    (.cg: a line left in this SM's L1 by an earlier launch cannot be served), then _route_row."""
    offs_e = tl.arange(0, E_PAD)                                     # [E_PAD]
    mask_e = offs_e < num_experts
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0)    # [E_PAD], once for all rows
    for n in range(num_tokens):
        logits = tl.load(logits_ptr + n * num_experts + offs_e, mask=mask_e, other=0.0,
                         cache_modifier=".cg")                       # [E_PAD]
        _route_row(logits, mask_e, offs_e, bias_ptr, bias, weights_ptr, ids_ptr, n, scaling,
                   TOP_K, RENORMALIZE, HAS_BIAS, BLOCK_OUT, EXTRA_ID, True)


@triton.jit
def router_gemv_topk_kernel(x_ptr, w_ptr, bias_ptr, logits_ptr, weights_ptr, ids_ptr,
                            ticket_ptr, num_tokens, num_experts, hidden, stride_xn, stride_we,
                            scaling,
                            TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                            HAS_BIAS: tl.constexpr, BLOCK_E: tl.constexpr,
                            BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, E_PAD: tl.constexpr,
                            BLOCK_OUT: tl.constexpr, EXTRA_ID: tl.constexpr = -1,
                            PREFETCH: tl.constexpr = 0, NUM_STAGES: tl.constexpr = 3,
                            USE_PDL: tl.constexpr = False, BLOCK_N: tl.constexpr = 4):
    """The whole decode router in one launch: logits GEMV, then sigmoid top-k in the program
    that finishes last.

    Contract. grid (cdiv(E, BLOCK_E),); num_tokens <= BLOCK_N (= 4, fixed: never derived from
    the batch). Program p: logits[n, e] = sum_k x[n, k] * w[e, k] in fp32 for its BLOCK_E
    experts and every token n < num_tokens (x bf16 / fp16 / fp32 read as fp32, w fp32 [E, D]),
    stored to the scratch logits_ptr [num_tokens, E] fp32. Reduction order: acc[n, e, k]
    accumulates the BLOCK_K chunks elementwise in ascending k0, then one tl.sum over k, on a
    [BLOCK_N, BLOCK_E, BLOCK_K] tile whose shape (hence register layout and reduction tree) is
    the same for every num_tokens: a token's logits depend on its own x row only (batch
    invariant), and PREFETCH / USE_PDL change when chunks load, not the order they are added.
    Then each program draws a ticket; the one drawing num_programs - 1 routes every token
    (_route_row: sigmoid, selection-only bias, TOP_K argmax rounds, renormalise, scale, the
    EXTRA_ID column) into weights fp32 and ids [num_tokens, TOP_K (+1)] (BLOCK_OUT: that width
    rounded up to a power of two), and sets the ticket back to 0. ticket_ptr: one int32, 0 at
    launch and 0 again when the grid ends. E_PAD: next_power_of_2(E), the routing row's width.

    Why the ticket is safe. tl.debug_barrier() makes every thread's logits stores happen before
    the program's single ticket atomic (Triton issues a scalar atomic from one thread);
    the atomic is acq_rel at gpu scope, so its release half orders those stores (cumulatively)
    before the increment. The program that draws the last ticket read-modify-wrote after every
    other increment, and its acquire half makes all their logits visible to it; the loads go
    through L2 (.cg). Nobody else reads the scratch. The reset (atomic_xchg to 0) runs after
    every program's increment (it is the last one), so the next launch, or the next replay of a
    CUDA graph, starts from 0. Two launches that may run at the same time must not share a
    ticket; launches in one stream may (each starts after the previous one ends, or with PDL
    after its griddepcontrol.wait, which waits for the previous grid to complete).

    PREFETCH (0..2, <= chunks): that many weight chunks are loaded before anything else. USE_PDL
    (programmatic dependent launch): griddepcontrol.wait after the prefetch (the weight is
    immutable) and before x, the scratch, the ticket or any output is touched, then
    griddepcontrol.launch_dependents. The bias is read only by the last program, after the wait.
    The K loop is software-pipelined NUM_STAGES deep (cp.async through shared memory): loads
    that feed no tl.dot are pipelined only when tl.range asks, not by the num_stages launch
    option. Experts past num_experts read row E - 1 (clamped) and are not stored.
    """
    pe = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)                                   # [BLOCK_N]
    offs_e = pe * BLOCK_E + tl.arange(0, BLOCK_E)                    # [BLOCK_E]
    offs_k = tl.arange(0, BLOCK_K)                                   # [BLOCK_K]
    rows_e = tl.minimum(offs_e, num_experts - 1).to(tl.int64)
    w_ptrs = w_ptr + rows_e[:, None] * stride_we + offs_k[None, :]   # [BLOCK_E, BLOCK_K]
    rows_n = offs_n.to(tl.int64)
    x_ptrs = x_ptr + rows_n[:, None] * stride_xn + offs_k[None, :]   # [BLOCK_N, BLOCK_K]
    n_mask = offs_n[:, None] < num_tokens                            # [BLOCK_N, 1]
    if PREFETCH >= 1:   # the weight is immutable: safe to read before the wait
        w0 = _weight_chunk(w_ptrs, 0, offs_k, hidden, EVEN_K)
    if PREFETCH >= 2:
        w1 = _weight_chunk(w_ptrs, BLOCK_K, offs_k, hidden, EVEN_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()                  # the previous kernel's writes are visible
        tl.extra.cuda.gdc_launch_dependents()     # the next PDL kernel may start its preamble
    acc = tl.zeros([BLOCK_N, BLOCK_E, BLOCK_K], dtype=tl.float32)
    if PREFETCH >= 1:
        acc = _logits_chunk(acc, x_ptrs, w0, 0, offs_k, n_mask, hidden, EVEN_K)
    if PREFETCH >= 2:
        acc = _logits_chunk(acc, x_ptrs, w1, BLOCK_K, offs_k, n_mask, hidden, EVEN_K)
    for k0 in tl.range(PREFETCH * BLOCK_K, hidden, BLOCK_K, num_stages=NUM_STAGES):
        w = _weight_chunk(w_ptrs, k0, offs_k, hidden, EVEN_K)        # [BLOCK_E, BLOCK_K]
        acc = _logits_chunk(acc, x_ptrs, w, k0, offs_k, n_mask, hidden, EVEN_K)
    logits = tl.sum(acc, axis=2)                                     # [BLOCK_N, BLOCK_E]
    out_ptrs = logits_ptr + offs_n[:, None] * num_experts + offs_e[None, :]
    tl.store(out_ptrs, logits, mask=n_mask & (offs_e[None, :] < num_experts))
    tl.debug_barrier()                  # every thread's stores before the program's atomic
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:                             # every other program is done
        _route_all_rows(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, num_experts,
                        scaling, TOP_K, RENORMALIZE, HAS_BIAS, E_PAD, BLOCK_OUT, EXTRA_ID)
        tl.atomic_xchg(ticket_ptr, 0)                                # ready for the next launch
