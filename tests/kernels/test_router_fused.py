"""One-launch decode router (moe_router_gemv_topk: logits GEMV + sigmoid top-k in the program that
finishes last). Run as a script under TRITON_INTERPRET=1 it is its own interpreter check
(fp32, against the reference on x @ w.T); under pytest: that script in a subprocess, the input
errors and the plan in process, an sm_90 compile of the kernel with checks on its PTX (the ticket
protocol), and GPU tests at the Kimi-Linear-48B shapes (E=256, D=2304)."""

import os

import pytest
import torch

import kernel_checks as kc

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
E, D, TOP_K, SCALING = 256, 2304, 8, 2.446
TICKET = dict(dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# Interpreter checks (this file run as __main__ with TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------


def routing_map(weights: torch.Tensor, ids: torch.Tensor, width: int) -> torch.Tensor:
    """[N, width] float64: each token's weight at its ids, 0 elsewhere (order-free)."""
    dense = torch.zeros(ids.shape[0], width, dtype=torch.float64)
    return dense.scatter_(1, ids.long(), weights.double())


def check_case(N: int, E: int, D: int, bias: bool, extra: bool, renormalize: bool) -> None:
    """Two calls in a row against the reference on x.float() @ w.T: same id set per row, the
    weight at each id within rtol 1e-5, the extra column, the ticket back at 0 after each call,
    the second call bitwise equal to the first."""
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.moe.router import moe_router_gemv_topk

    name = f"N={N} E={E} D={D} bias={bias} extra={extra} renormalize={renormalize}"
    top_k = 6
    x = torch.randn(N, D)                                            # [N, D] fp32
    w = torch.randn(E, D) / D ** 0.5                                 # [E, D] fp32
    b = torch.randn(E) * 0.1 if bias else None                       # [E]
    ticket = torch.zeros(1, **TICKET)
    outs = []
    for _ in range(2):
        outs.append(moe_router_gemv_topk(x, w, b, top_k, renormalize, SCALING, ticket,
                                         extra_expert=E if extra else None))
        assert int(ticket) == 0, f"{name}: ticket {int(ticket)} after the call"
    (weights, ids), (weights2, ids2) = outs
    assert torch.equal(weights, weights2) and torch.equal(ids, ids2), f"{name}: calls differ"
    assert weights.shape == ids.shape == (N, top_k + extra), name
    w_ref, ids_ref = ref.moe_topk_sigmoid(x.float() @ w.T, b if bias else torch.zeros(E), top_k,
                                          renormalize, SCALING)
    got_ids = ids[:, :top_k].long()
    assert torch.equal(got_ids.sort(1)[0], ids_ref.sort(1)[0]), f"{name}: id sets differ"
    torch.testing.assert_close(routing_map(weights[:, :top_k], got_ids, E),
                               routing_map(w_ref, ids_ref, E), rtol=1e-5, atol=0, msg=name)
    if extra:
        assert bool((weights[:, top_k] == 1).all()) and bool((ids[:, top_k] == E).all()), name


def check_against_reference() -> None:
    """N in 1, 2, 4 with every option on and off across the cases. E=64, D=96: one program per
    expert (64 <= 132 SMs), one ragged K chunk (96 < BLOCK_K 256); E=301, D=600: BLOCK_E 4 with
    a ragged last expert block (clamped rows) and a 3-chunk K loop with a ragged last chunk."""
    torch.manual_seed(0)
    options = [(True, True, True), (False, False, True), (True, False, False),
               (False, True, False)]                                # (bias, extra, renormalize)
    for N in (1, 2, 4):
        for bias, extra, renorm in options:
            check_case(N, 64, 96, bias, extra, renorm)
    check_case(3, 301, 600, True, True, True)


def check_batch_invariance() -> None:
    """Token 0 alone and in batches of 2 and 4: bitwise the same outputs."""
    from kdaserve.kernels.moe.router import moe_router_gemv_topk

    torch.manual_seed(2)
    x, w, b = torch.randn(4, 96), torch.randn(64, 96) / 96 ** 0.5, torch.randn(64) * 0.1
    ticket = torch.zeros(1, **TICKET)
    outs = [moe_router_gemv_topk(x[:n], w, b, 6, True, SCALING, ticket) for n in (1, 2, 4)]
    for weights, ids in outs[1:]:
        assert torch.equal(weights[:1], outs[0][0]) and torch.equal(ids[:1], outs[0][1])


def check_prefetch_order() -> None:
    """The kernel launched directly with PREFETCH 0, 1, 2 (pdl's weight prefetch; the wrapper
    uses it on CUDA only): bitwise the same outputs, the ticket back at 0."""
    from kdaserve.kernels.moe.triton_router import router_gemv_topk_kernel

    torch.manual_seed(3)
    N, E, D, k = 3, 40, 600, 4
    x, w, b = torch.randn(N, D), torch.randn(E, D) / D ** 0.5, torch.randn(E) * 0.1
    ticket = torch.zeros(1, **TICKET)
    outs = []
    for prefetch in (0, 1, 2):
        logits = torch.empty(N, E)
        weights, ids = torch.empty(N, k), torch.empty(N, k, dtype=torch.int32)
        router_gemv_topk_kernel[(E,)](
            x, w, b, logits, weights, ids, ticket, N, E, D, D, D, SCALING, TOP_K=k,
            RENORMALIZE=True, HAS_BIAS=True, BLOCK_E=1, BLOCK_K=256, EVEN_K=False, E_PAD=64,
            BLOCK_OUT=4, PREFETCH=prefetch, NUM_STAGES=2)
        assert int(ticket) == 0, f"PREFETCH={prefetch}: ticket {int(ticket)}"
        outs.append((logits, weights, ids))
    for out in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out, outs[0])), "PREFETCH changed results"
    torch.testing.assert_close(outs[0][0], x @ w.T, rtol=1e-5, atol=1e-5)


def check_input_errors() -> None:
    from kdaserve.kernels.moe.router import ROUTER_FUSED_MAX_TOKENS, moe_router_gemv_topk

    x, w, ticket = torch.randn(2, 96), torch.randn(64, 96), torch.zeros(1, **TICKET)
    too_many = torch.randn(ROUTER_FUSED_MAX_TOKENS + 1, 96)
    cases = [(too_many, w, ticket, "N=5"), (x, w[:, :50], ticket, "D=96"),
             (x, w.double(), ticket, "fp32"), (x.int(), w, ticket, "bf16"),
             (x, w, torch.zeros(1, dtype=torch.int64), "ticket"),
             (x, w, torch.zeros(2, **TICKET), "ticket")]
    for bad_x, bad_w, bad_t, needle in cases:
        try:
            moe_router_gemv_topk(bad_x, bad_w, None, 4, True, 1.0, bad_t)
        except ValueError as e:
            assert needle in str(e), str(e)
        else:
            raise AssertionError(f"no ValueError for {needle}")
    empty = moe_router_gemv_topk(x[:0], w, None, 4, True, 1.0, ticket)
    assert empty[0].shape == (0, 4) and int(ticket) == 0


def run_interpreter_checks() -> None:
    check_input_errors()
    check_prefetch_order()
    check_batch_invariance()
    check_against_reference()


# ---------------------------------------------------------------------------------------------
# CPU (pytest)
# ---------------------------------------------------------------------------------------------


def test_router_fused_interpreter():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("test_router_fused.py", timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_too_many_tokens_names_n():
    pytest.importorskip("triton")
    from kdaserve.kernels.moe.router import moe_router_gemv_topk

    with pytest.raises(ValueError, match="N=5"):
        moe_router_gemv_topk(torch.randn(5, 64), torch.randn(8, 64), None, 2, True, 1.0,
                             torch.zeros(1, **TICKET))


def test_plan():
    """E=256, 132 SMs: 128 programs of 2 experts; one wave where E allows; at most 4."""
    from kdaserve.kernels.moe.router import router_fused_plan

    assert router_fused_plan(256, 2304, 132) == 2
    assert router_fused_plan(64, 96, 132) == 1
    assert router_fused_plan(301, 600, 132) == 4
    assert router_fused_plan(256, 2304, 78) == 4
    assert router_fused_plan(4096, 2304, 132) == 4                   # capped: several waves


def _compile_sm90_ptx(x_dtype: str, pdl: bool) -> str:
    """PTX of the kernel at the model's launch (E=256, D=2304, BLOCK_E 2, 9 stages) for sm_90,
    compiled with Triton's own toolchain (no GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kdaserve.kernels.moe.triton_router import router_gemv_topk_kernel as kernel

    names = [p.name for p in kernel.params]
    consts = dict(TOP_K=TOP_K, RENORMALIZE=True, HAS_BIAS=True, BLOCK_E=2, BLOCK_K=256,
                  EVEN_K=True, E_PAD=256, BLOCK_OUT=16, EXTRA_ID=E, PREFETCH=2 if pdl else 0,
                  NUM_STAGES=8 if pdl else 9, USE_PDL=pdl, BLOCK_N=4)
    sig = {n: "constexpr" if n in consts else ("*" + x_dtype if n == "x_ptr" else "*fp32")
           for n in names}
    sig.update(ids_ptr="*i32", ticket_ptr="*i32", num_tokens="i32", num_experts="i32",
               hidden="i32", stride_xn="i32", stride_we="i32", scaling="fp32")
    aligned = [n for n in names if n.endswith("_ptr")] + ["hidden", "stride_xn", "stride_we"]
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    options = dict(num_warps=2, **({"launch_pdl": True} if pdl else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


@pytest.mark.parametrize("x_dtype,pdl", [("bf16", False), ("fp32", False), ("bf16", True)])
def test_compiles_for_sm90_with_the_ticket_protocol(x_dtype, pdl):
    """In the PTX: a pipelined K loop (cp.async); every logits store, then bar.sync, then one
    gpu-scope acq_rel atomic add; .cg loads of the logits; the acq_rel exchange that resets the
    ticket. With pdl: griddepcontrol.wait before any store, atomic or cp.async, after the
    weight prefetch loads."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("compiling needs the non-interpreted kernel")
    lines = [line.strip() for line in _compile_sm90_ptx(x_dtype, pdl).splitlines()]
    text = "\n".join(lines)

    def first(needle: str) -> int:
        return next(i for i, line in enumerate(lines) if needle in line)

    assert "cp.async" in text, "K loop not pipelined"
    add = first("atom.global.gpu.acq_rel.add")
    before = [i for i, line in enumerate(lines[:add]) if "st.global" in line or "bar.sync" in line]
    assert before and "bar.sync" in lines[before[-1]], "no barrier between the stores and atomic"
    assert any("st.global" in lines[i] for i in before), "no logits store before the atomic"
    assert "ld.global.cg" in text[text.index("atom.global.gpu.acq_rel.add"):], "no .cg reload"
    assert "atom.global.gpu.acq_rel.exch" in text, "no ticket reset"
    if pdl:
        wait = first("griddepcontrol.wait")
        assert wait < min(first("cp.async"), first("st.global"), add)
        assert any(line.startswith("ld.global") for line in lines[:wait]), "no weight prefetch"
    else:
        assert "griddepcontrol" not in text


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def _inputs(n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, D, device="cuda", generator=g).bfloat16()         # [N, D] bf16
    w = torch.randn(E, D, device="cuda", generator=g) / D ** 0.5         # [E, D] fp32
    b = torch.randn(E, device="cuda", generator=g) * 0.1                 # [E]
    return x, w, b


def _route(x, w, b, ticket, pdl=False):
    from kdaserve.kernels.moe.router import moe_router_gemv_topk

    return moe_router_gemv_topk(x, w, b, TOP_K, True, SCALING, ticket, extra_expert=E, pdl=pdl)


def _ticket():
    return torch.zeros(1, device="cuda", **TICKET)


def _needs_sm90():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [1, 2, 4])
def test_matches_gemv_then_topk_gpu(n):
    """Against gemv (fp32 out) + moe_topk_sigmoid: the same ids in the same order, weights
    within 1e-6; the ticket back at 0."""
    from kdaserve.kernels.linear.gemv import gemv
    from kdaserve.kernels.moe.router import moe_topk_sigmoid

    x, w, b = _inputs(n, seed=n)
    ticket = _ticket()
    weights, ids = _route(x, w, b, ticket)
    logits = gemv(x, w, out_dtype=torch.float32)                      # [N, E]
    old_w, old_ids = moe_topk_sigmoid(logits, b, TOP_K, True, SCALING, extra_expert=E)
    assert torch.equal(ids, old_ids)
    torch.testing.assert_close(weights, old_w, rtol=1e-6, atol=1e-6)
    assert int(ticket.item()) == 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [1, 2, 4])
def test_pdl_is_bitwise_the_same_gpu(n):
    _needs_sm90()
    x, w, b = _inputs(n, seed=10 + n)
    ticket = _ticket()
    off, on = _route(x, w, b, ticket), _route(x, w, b, ticket, pdl=True)
    assert torch.equal(off[0], on[0]) and torch.equal(off[1], on[1])
    assert int(ticket.item()) == 0


@pytest.mark.gpu
@gpu
def test_batch_invariance_gpu():
    """Token 0 alone, in batches of 2 and 4, and from an fp32 copy of x: bitwise the same."""
    x, w, b = _inputs(4, seed=7)
    ticket = _ticket()
    alone = _route(x[:1], w, b, ticket)
    for out in (_route(x[:2], w, b, ticket), _route(x, w, b, ticket),
                _route(x.float(), w, b, ticket)):
        assert torch.equal(out[0][:1], alone[0]) and torch.equal(out[1][:1], alone[1])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_graph_of_26_calls_gpu(pdl):
    """26 calls (one ticket each, like the 26 MoE layers) in one CUDA graph, replayed 5 times
    with the outputs poisoned before each replay: every replay writes the eager outputs again
    and leaves every ticket at 0."""
    if pdl:
        _needs_sm90()
    layers, n = 26, 2
    x, w, b = _inputs(layers * n, seed=5)
    xs = x.view(layers, n, D)
    tickets = [_ticket() for _ in range(layers)]

    def step():
        return [_route(xs[i], w, b, tickets[i], pdl=pdl) for i in range(layers)]

    want = step()
    graph, outs = kc.capture_graph(step)
    for replay in range(5):
        for weights, ids in outs:
            weights.fill_(float("nan"))
            ids.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        for i, ((weights, ids), (w_want, ids_want)) in enumerate(zip(outs, want)):
            assert torch.equal(weights, w_want) and torch.equal(ids, ids_want), (replay, i)
        assert all(int(t.item()) == 0 for t in tickets), replay


if __name__ == "__main__":
    kc.patch_triton_interpreter()
    run_interpreter_checks()
    print("ok")
