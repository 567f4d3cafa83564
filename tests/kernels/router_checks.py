"""Interpreter checks of the split-K router (moe_router_splitk: split-K logits GEMV + top-k summing
the partials) against the float64 reference; run by test_router_splitk.py in a subprocess with
TRITON_INTERPRET=1, and recorded by test_compile_sm90.py for the sm_90 compile."""

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_checks  # noqa: E402

kernel_checks.patch_triton_interpreter()

from kdaserve.kernels import reference as ref  # noqa: E402
from kdaserve.kernels.moe.router import (ROUTER_SPLITK_MAX_TOKENS, moe_router_splitk,  # noqa: E402
                                         router_splitk_plan)

X_KINDS = ("fp32", "bf16-valued fp32", "bf16")


def make_x(N: int, D: int, kind: str) -> torch.Tensor:
    x = torch.randn(N, D)                                            # [N, D]
    if kind == "fp32":
        return x
    x = x.bfloat16()
    return x.float() if kind == "bf16-valued fp32" else x


def routing_map(weights: torch.Tensor, ids: torch.Tensor, E: int) -> torch.Tensor:
    """[N, E] float64: each token's weight at its chosen ids, 0 elsewhere (order-free)."""
    dense = torch.zeros(ids.shape[0], E, dtype=torch.float64)
    return dense.scatter_(1, ids.long(), weights.double())


def check_case(N: int, E: int, D: int, kind: str, bias: bool, extra: bool) -> None:
    name = f"N={N} E={E} D={D} x={kind} bias={bias} extra={extra}"
    top_k = min(8, E)
    x = make_x(N, D, kind)
    w = torch.randn(E, D) / D ** 0.5                                 # [E, D] fp32
    b = torch.randn(E) * 0.1 if bias else None
    extra_id = E if extra else None
    weights, ids = moe_router_splitk(x, w, b, top_k, True, 2.446, extra_expert=extra_id)
    assert weights.shape == ids.shape == (N, top_k + extra), name
    logits = x.double() @ w.double().T                               # [N, E] float64
    w_ref, ids_ref = ref.moe_topk_sigmoid(logits, b if bias else torch.zeros(E), top_k, True,
                                          2.446)
    got_ids = ids[:, :top_k].long()
    assert torch.equal(got_ids.sort(1)[0], ids_ref.sort(1)[0]), f"{name}: id sets differ"
    got, want = routing_map(weights[:, :top_k], got_ids, E), routing_map(w_ref, ids_ref, E)
    err = ((got - want).abs() / want.abs().clamp_min(1e-30)).where(want != 0, 0.0).max().item()
    assert err <= 1e-5, f"{name}: weight relative error {err:.2e} > 1e-5"
    if extra:
        assert bool((weights[:, top_k] == 1).all()) and bool((ids[:, top_k] == E).all()), name
    scores = torch.sigmoid(logits) + (b.double() if bias else 0.0)
    picked = scores.gather(1, got_ids)                               # [N, top_k]
    assert bool((picked[:, :-1] >= picked[:, 1:] - 1e-6).all()), f"{name}: ids not in score order"


def check_against_reference() -> None:
    """N in {1, 3, 16, 64} x (E, D) in {(256, 2304), (40, 300)} (300: not a multiple of
    BLOCK_K, a ragged last split), cycling the x kinds and the bias / extra-expert options;
    plus the two mixed shapes."""
    torch.manual_seed(0)
    cases = list(itertools.product((1, 3, 16, 64), ((256, 2304), (40, 300))))
    for i, (N, (E, D)) in enumerate(cases):
        check_case(N, E, D, X_KINDS[i % 3], bias=i % 2 == 0, extra=i % 4 < 2)
    check_case(16, 256, 300, "bf16", bias=True, extra=True)
    check_case(64, 40, 2304, "fp32", bias=False, extra=False)


def check_plan() -> None:
    """The model shape: 144 programs of 128-wide K slices; every plan covers D in whole
    BLOCK_K chunks with at most 32 partials."""
    assert router_splitk_plan(256, 2304, 132) == (32, 128, 18)
    for E, D in [(256, 2304), (40, 300), (40, 2304), (7, 10), (256, 300)]:
        _, k_per_split, split_k = router_splitk_plan(E, D, 132)
        assert k_per_split % 32 == 0 and split_k <= 32, (E, D)
        assert (split_k - 1) * k_per_split < D <= split_k * k_per_split, (E, D)


def check_misc() -> None:
    """ids_dtype, no renormalisation, determinism, N == 0 and the input errors."""
    torch.manual_seed(1)
    x, w = torch.randn(5, 300), torch.randn(40, 300) / 300 ** 0.5
    w1, i1 = moe_router_splitk(x, w, None, 4, False, 1.0, ids_dtype=torch.int64)
    w2, i2 = moe_router_splitk(x, w, None, 4, False, 1.0, ids_dtype=torch.int64)
    assert i1.dtype == torch.int64 and torch.equal(w1, w2) and torch.equal(i1, i2)
    w_ref, ids_ref = ref.moe_topk_sigmoid(x.double() @ w.double().T, torch.zeros(40), 4, False,
                                          1.0)
    assert torch.equal(i1.sort(1)[0], ids_ref.sort(1)[0])
    torch.testing.assert_close(routing_map(w1, i1, 40), routing_map(w_ref, ids_ref, 40),
                               rtol=1e-5, atol=0)
    empty = moe_router_splitk(x[:0], w, None, 4, True, 1.0)
    assert empty[0].shape == (0, 4)
    too_many = torch.randn(ROUTER_SPLITK_MAX_TOKENS + 1, 300)
    for bad_x, bad_w, needle in [(too_many, w, "N=65"), (x, w[:, :200], "D=300"),
                                 (x, w.double(), "fp32"), (x.int(), w, "bf16")]:
        try:
            moe_router_splitk(bad_x, bad_w, None, 4, True, 1.0)
        except ValueError as e:
            assert needle in str(e), str(e)
        else:
            raise AssertionError(f"no ValueError for {needle}")


if __name__ == "__main__":
    check_plan()
    check_misc()
    check_against_reference()
    print("ok")
