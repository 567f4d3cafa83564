"""Interpreter checks (fp32) of the split-plane conv output, the router's shared-expert column and
logits GEMM, and the fused RMS norms; run by test_interp_extras.py in a subprocess with
TRITON_INTERPRET=1."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_checks  # noqa: E402

kernel_checks.patch_triton_interpreter()

from kdaserve.kernels import reference as ref  # noqa: E402
from kdaserve.kernels.conv.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen  # noqa: E402,E501
from kdaserve.kernels.moe.router import (RouterGemmConfig, RouterPartialsPlan,  # noqa: E402
                                         moe_topk_sigmoid, router_gemm_config, router_logits,
                                         router_partials, router_partials_plan)
from kdaserve.kernels.norm.rms_norm import add_rms_norm, rms_norm_gated  # noqa: E402


def check_conv_split() -> None:
    torch.manual_seed(0)
    T, D, W, S = 40, 48, 4, 5
    x, w = torch.randn(T, D), torch.randn(D, W)
    cu = torch.tensor([0, 7, 30, 40], dtype=torch.int32)
    st0 = torch.randn(S, D, W - 1)
    idx, has = torch.tensor([3, 0, 2], dtype=torch.int32), torch.tensor([True, False, True])
    st_a, st_b = st0.clone(), st0.clone()
    ya = causal_conv1d_varlen(x, w, cu, st_a, idx, has)
    planes = torch.full((3, T + 5, D // 3), float("nan"))[:, 2:T + 2]     # strided planes
    causal_conv1d_varlen(x, w, cu, st_b, idx, has, out=planes)
    assert torch.equal(ya, planes.permute(1, 0, 2).reshape(T, D)) and torch.equal(st_a, st_b)
    xb = torch.randn(3, D)
    ua = causal_conv1d_update(xb, w, st_a, idx)
    ub = causal_conv1d_update(xb, w, st_b, idx, out=torch.empty(3, 3, D // 3))
    assert torch.equal(ua, ub.permute(1, 0, 2).reshape(3, D)) and torch.equal(st_a, st_b)


def _topk_expected(logits, bias, k, renormalize, scaling):
    """The selection written out: experts by descending sigmoid + bias, ties to the lowest
    index (a stable sort), weights the chosen sigmoids, renormalised and scaled."""
    scores = torch.sigmoid(logits.float())
    select = scores + (bias if bias is not None else 0.0)
    ids = torch.sort(select, dim=1, descending=True, stable=True).indices[:, :k]
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(1, keepdim=True) + 1e-20)
    return w * scaling, ids.int()


def check_router_extra() -> None:
    torch.manual_seed(1)
    for E, k in [(8, 2), (256, 8), (256, 16), (7, 7)]:
        lg, b = torch.randn(37, E), torch.randn(E) * 0.1
        w1, i1 = moe_topk_sigmoid(lg, b, k, True, 2.446, extra_expert=E)
        wr, ir = _topk_expected(lg, b, k, True, 2.446)
        assert bool((w1[:, k] == 1).all()) and bool((i1[:, k] == E).all())
        assert torch.equal(i1[:, :k], ir), (E, k)         # same experts, same order
        assert (w1[:, :k] - wr).abs().max() < 1e-6
        wt, it = ref.moe_topk_sigmoid(lg, b, k, True, 2.446)    # the twin: same set
        assert torch.equal(i1[:, :k].long().sort(1)[0], it.sort(1)[0])
        for warps in (1, 2, 8):   # the warp count changes the schedule, not the selection
            w2, i2 = moe_topk_sigmoid(lg, b, k, True, 2.446, extra_expert=E, num_warps=warps)
            assert torch.equal(i2, i1) and torch.equal(w2, w1)
    # ties (equal selection scores) go to the lowest expert index; no bias; k up to E; output
    # wider than the expert count (top 3 of 3 + the shared column)
    lg = torch.randn(9, 16).round()
    for k in (3, 8, 16):
        got = moe_topk_sigmoid(lg, None, k, False, 1.0)
        want = _topk_expected(lg, None, k, False, 1.0)
        assert torch.equal(got[1], want[1]) and (got[0] - want[0]).abs().max() < 1e-6, k
    lg = torch.randn(5, 3)
    w, i = moe_topk_sigmoid(lg, None, 3, True, 1.0, extra_expert=3)
    want = _topk_expected(lg, None, 3, True, 1.0)
    assert torch.equal(i[:, :3], want[1]) and bool((i[:, 3] == 3).all())


def check_norms() -> None:
    torch.manual_seed(2)
    for n, d in [(1, 96), (7, 40)]:
        x, r, w = torch.randn(n, d), torch.randn(n, d), torch.rand(d) + 0.5
        out, s = add_rms_norm(x.clone(), w, 1e-5, r.clone())
        ref_out, ref_s = ref.add_rms_norm(x, w, 1e-5, r)
        torch.testing.assert_close(s, ref_s, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        out32 = torch.full((n, d), float("nan"))
        out, s = add_rms_norm(x, w, 1e-5, r.clone(), out32=out32)
        assert torch.equal(out32, out.float())
        out, s = add_rms_norm(x, w, 1e-5)
        assert s is x
        torch.testing.assert_close(out, ref.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    x = torch.randn(9, 32)
    g = torch.randn(9, 3, 32)[:, 1]                                     # strided rows
    w = torch.rand(32) + 0.5
    torch.testing.assert_close(rms_norm_gated(x, g, w, 1e-5), ref.rms_norm_gated(x, g, w, 1e-5),
                               rtol=1e-5, atol=1e-5)
    # many rows: several rows a program, the last program partly past N
    x, g = torch.randn(8250, 40), torch.randn(8250, 2, 40)[:, 0]
    w = torch.rand(40) + 0.5
    torch.testing.assert_close(rms_norm_gated(x, g, w, 1e-5), ref.rms_norm_gated(x, g, w, 1e-5),
                               rtol=1e-5, atol=1e-5)


def check_router_logits() -> None:
    """bf16 x against fp32 weights: the three-way bf16 split of each weight reproduces the fp32
    GEMM (to fp32 rounding), far closer than a bf16 weight would (~1e-3 here). Masked and
    unmasked K, partial row and expert tiles, the default tiles shrunk to a small problem."""
    torch.manual_seed(3)
    cases = [(70, 24, 100, RouterGemmConfig(32, 16, 32, 4, 1)),
             (33, 16, 64, RouterGemmConfig(16, 16, 16, 4, 1)),
             (65, 40, 64, router_gemm_config(65, 40, 64)),
             (70, 40, 200, router_gemm_config(70, 40, 200)),
             (2050, 24, 64, router_gemm_config(2050, 24, 64))]
    for n, e, d, cfg in cases:
        x = torch.randn(n, d).bfloat16()
        w = torch.randn(e, d) * 0.05
        want = torch.nn.functional.linear(x.double(), w.double())
        got = router_logits(x, w, cfg)
        assert got.dtype == torch.float32 and got.shape == (n, e)
        err = (got.double() - want).abs().max().item()
        assert err < 1e-6 * want.abs().max().item() * d ** 0.5, err


def check_router_partials() -> None:
    """bf16 x against fp32 weights in K splits: the partials summed in split order are the fp32
    GEMM (to fp32 rounding) at the planned splits (one, two and several; masked and unmasked
    K; partial row and expert tiles) and at a given plan, and the top-k kernel over the
    partials selects and weighs what it does over their sum."""
    torch.manual_seed(4)
    cases = [(9, 64, 256, None), (1, 40, 100, None), (20, 24, 200, None), (70, 40, 64, None),
             (5, 16, 96, RouterPartialsPlan(16, 8, 32, 3, 32, 4, 1))]
    for n, e, d, plan in cases:
        x = torch.randn(n, d).bfloat16()
        w = torch.randn(e, d) * 0.05
        want = torch.nn.functional.linear(x.double(), w.double())
        part = router_partials(x, w, plan)
        p = plan or router_partials_plan(n, e, d)
        assert part.dtype == torch.float32 and part.shape == (p.splits, n, e), part.shape
        total = part[0].clone()
        for s in range(1, p.splits):
            total += part[s]
        err = (total.double() - want).abs().max().item()
        assert err < 1e-6 * want.abs().max().item() * d ** 0.5, err
        bias = torch.randn(e) * 0.1
        k = min(4, e)
        got = moe_topk_sigmoid(part, bias, k, True, 2.5, extra_expert=e)
        summed = moe_topk_sigmoid(total, bias, k, True, 2.5, extra_expert=e)
        assert torch.equal(got[0], summed[0]) and torch.equal(got[1], summed[1])
    assert [router_partials_plan(n, 256, 2304).splits for n in (1, 16, 17, 33, 64, 65)] == \
        [8, 8, 4, 2, 2, 1]
    try:
        router_partials(torch.randn(3, 64).bfloat16(), torch.randn(8, 64),
                        RouterPartialsPlan(16, 8, 32, 1, 48, 4, 1))
    except ValueError as e:
        assert "k_split must be a multiple of block_k" in str(e), e
    else:
        raise AssertionError("a plan whose k_split is not a multiple of block_k was accepted")


if __name__ == "__main__":
    check_conv_split()
    check_router_extra()
    check_router_logits()
    check_router_partials()
    check_norms()
    print("ok")
