"""Sort-free top-k / top-p threshold (kdaserve.kernels.sample.top_p) vs its sort twin.

The kernel's kept set (logits >= tau) must hold the reference's, its extra tokens must sit within
1e-4 of the reference's tau, it must keep top_p of the mass, tau <= row max, and a row with both
filters off gets -inf. The boundary is compared at top_p * (1 -/+ 1e-6): fp32 sums in another
order may move a token whose mass lands within 1e-6 of top_p * Z across the line.

The fp32 interpreter cases run this file as a script in a subprocess with TRITON_INTERPRET=1;
the GPU tests (marked gpu) use the model's vocabulary, 163840.
"""

import os

import pytest
import torch

import kernel_checks as kc
from kdaserve.kernels.reference import top_k_top_p_threshold_ref
from kdaserve.sample.sampler import apply_top_k_top_p

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
INF = float("inf")
MASS_RTOL = 1e-6
EXTRA_ATOL = 1e-4
# (top_k, top_p) per row; "V" is the vocabulary, "V+" more than it
MIXED = [(0, 1.0), (50, 1.0), (0, 0.9), (20, 0.8), (1, 1e-6), ("V", 0.95), ("V+", 0.5),
         (7, 1.0), (0, 1e-6), (3, 0.999)]


def make_logits(kind: str, B: int, V: int, device: str, seed: int = 0) -> torch.Tensor:
    """[B, V] fp32: normal (scale 1 or 8), exact ties, -inf bans, or one +30 logit per row."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, V, generator=g)
    if kind == "normal8":
        x = x * 8
    elif kind == "ties":
        x = torch.randint(-6, 7, (B, V), generator=g).float() * 0.5
    elif kind == "bans":
        x = x * 2
        x[torch.rand(B, V, generator=g) < 0.5] = -INF
        x[0, 1:] = -INF                                  # one finite token
        x[0, 0] = 1.5
    elif kind == "peaked":
        x[torch.arange(B), torch.randint(0, V, (B,), generator=g)] = 30.0
    return x.to(device)


def make_settings(rows: list, V: int, device: str, use_k: bool = True, use_p: bool = True):
    """(top_k int32 [B] or None, top_p fp32 [B] or None) from (k, p) pairs."""
    ks = [V if k == "V" else V + 9 if k == "V+" else k for k, _ in rows]
    top_k = torch.tensor(ks, dtype=torch.int32, device=device) if use_k else None
    top_p = torch.tensor([p for _, p in rows], dtype=torch.float32, device=device) if use_p \
        else None
    return top_k, top_p


def _mixed(start: int, B: int) -> list:
    return [MIXED[(start + i) % len(MIXED)] for i in range(B)]


def _nudged(top_p: torch.Tensor | None, factor: float) -> torch.Tensor | None:
    if top_p is None:
        return None
    return torch.where(top_p >= 1, top_p, top_p * factor)


def check_threshold(name: str, logits, top_k, top_p, **kw) -> None:
    """The kernel's tau against the reference's (guarantees a-e of the contract)."""
    from kdaserve.kernels.sample.top_p import top_k_top_p_threshold

    tau = top_k_top_p_threshold(logits, top_k, top_p, **kw)
    x, k, p = logits, top_k, top_p                   # the reference runs on the same device
    B = x.shape[0]
    assert tau.shape == (B,) and tau.dtype == torch.float32 and not tau.isnan().any(), name
    kept = x >= tau[:, None]                                            # [B, V]

    every_row = torch.ones(B, dtype=torch.bool, device=x.device)
    k_off = every_row if k is None else k <= 0
    p_off = every_row if p is None else p >= 1
    assert (tau[k_off & p_off] == -INF).all(), f"{name}: rows with both filters off: {tau}"
    assert (tau <= x.max(dim=1).values).all(), f"{name}: tau above the row max"

    strict = top_k_top_p_threshold_ref(x, k, _nudged(p, 1 - MASS_RTOL))  # [B]
    missing = (x >= strict[:, None]) & ~kept
    assert not missing.any(), (f"{name}: dropped tokens the reference keeps, rows "
                               f"{missing.any(1).nonzero().flatten().tolist()}: tau {tau} "
                               f"ref {strict}")
    loose = top_k_top_p_threshold_ref(x, k, _nudged(p, 1 + MASS_RTOL))
    extra = kept & (x < loose[:, None])
    far = extra & (x < loose[:, None] - EXTRA_ATOL)
    assert not far.any(), (f"{name}: extra tokens further than {EXTRA_ATOL} below the "
                           f"reference tau, rows {far.any(1).nonzero().flatten().tolist()}: "
                           f"tau {tau} ref {loose}")
    if p is not None:
        probs = torch.softmax(x.double(), dim=-1)
        tk = top_k_top_p_threshold_ref(x, k, None).double()
        z = (probs * (x >= tk[:, None])).sum(1)
        mass = (probs * kept).sum(1)
        short = (p < 1) & (mass < p.double() * z - 1e-5)
        assert not short.any(), f"{name}: kept mass {mass} below top_p {p} x Z {z}"


def run_interpreter_cases(V: int = 2000) -> None:
    """The CPU interpreter cases (fp32, B <= 5, a few thousand tokens)."""
    kc.patch_triton_interpreter()
    for i, kind in enumerate(("normal", "normal8", "ties", "peaked")):
        rows = _mixed(3 * i, 5)
        check_threshold(f"{kind} mixed", make_logits(kind, 5, V, "cpu", seed=i), *make_settings(
            rows, V, "cpu"))
    ban_rows = [("V", 0.9), (5, 1.0), (0, 0.5), ("V+", 0.95), (10, 1e-6)]
    check_threshold("bans", make_logits("bans", 5, V, "cpu", seed=7),
                    *make_settings(ban_rows, V, "cpu"))
    k_rows = [(1, 1.0), ("V", 1.0), ("V+", 1.0), (0, 1.0), (17, 1.0)]
    check_threshold("top_k only", make_logits("normal", 5, V, "cpu", seed=8),
                    *make_settings(k_rows, V, "cpu", use_p=False))
    p_rows = [(0, 1.0), (0, 1e-6), (0, 0.3), (0, 0.95), (0, 0.999)]
    check_threshold("top_p only", make_logits("normal8", 5, V, "cpu", seed=9),
                    *make_settings(p_rows, V, "cpu", use_k=False))
    check_threshold("8 pivots x 8 passes", make_logits("normal", 3, V, "cpu", seed=10),
                    *make_settings(_mixed(2, 3), V, "cpu"), num_pivots=8, passes=8)
    check_threshold("64-token steps, 1 warp", make_logits("normal", 3, V, "cpu", seed=11),
                    *make_settings(_mixed(4, 3), V, "cpu"), tiles=(64, 1))
    for v in (1, 37):                                   # one block, one split
        check_threshold(f"V={v}", make_logits("normal8", 3, v, "cpu", seed=v),
                        *make_settings([(1, 0.5), ("V", 0.9), (2, 1.0)], v, "cpu"))


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------


def test_interpreter_cases():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("test_top_p_threshold.py", timeout=120)
    assert proc.returncode == 0 and "passed" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 3.0), (2, 0.3)])
def test_reference_matches_sampler(seed, scale):
    """On tie-free logits the reference keeps exactly what apply_top_k_top_p keeps."""
    V = 1000
    rows = _mixed(seed, 10)
    x = make_logits("normal", 10, V, "cpu", seed=seed) * scale
    assert all(row.unique().numel() == V for row in x), "ties in the test logits"
    top_k, top_p = make_settings(rows, V, "cpu")
    for k, p in ((top_k, top_p), (top_k, None), (None, top_p)):
        tau = top_k_top_p_threshold_ref(x, k, p)
        want = apply_top_k_top_p(x, k, p) > -INF
        assert torch.equal(x >= tau[:, None], want), f"k={k is not None} p={p is not None}"


def test_reference_keeps_ties_and_the_max():
    x = torch.tensor([[2.0, 2.0, 0.0, -INF], [3.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    tau = top_k_top_p_threshold_ref(x, torch.tensor([1, 2, 0]), torch.tensor([0.1, 1.0, 0.3]))
    assert tau.tolist() == [2.0, 1.0, 0.0]       # ties with the boundary are kept
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    for top_p, n_kept in ((0.45, 1), (0.75, 2), (0.85, 3)):
        tau = top_k_top_p_threshold_ref(logits, None, torch.tensor([top_p]))
        assert (logits >= tau[:, None]).sum().item() == n_kept, top_p
    tau = top_k_top_p_threshold_ref(logits, torch.tensor([2]), torch.tensor([0.7]))
    assert (logits >= tau[:, None]).sum().item() == 2   # 0.5 / 0.8 < 0.7: renormalised top-k


def test_both_filters_off_needs_no_kernel():
    from kdaserve.kernels.sample.top_p import top_k_top_p_threshold

    tau = top_k_top_p_threshold(torch.randn(3, 10))
    assert tau.shape == (3,) and (tau == -INF).all()


def test_refuses_cpu_tensors_without_interpreter():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("interpreter mode accepts CPU tensors")
    from kdaserve.kernels.sample.top_p import top_k_top_p_threshold

    with pytest.raises(ValueError, match="CUDA"):
        top_k_top_p_threshold(torch.randn(2, 10), None, torch.full((2,), 0.9))


@pytest.mark.parametrize("args,kw,match", [
    ((torch.randn(2, 10, dtype=torch.float64), None, torch.ones(2)), {}, "torch.float64"),
    ((torch.randn(10, 2).t(), None, torch.ones(2)), {}, "contiguous=False"),
    ((torch.randn(2, 10), torch.ones(3, dtype=torch.int32), None), {}, r"top_k .*\(3,\)"),
    ((torch.randn(2, 10), torch.ones(2), None), {}, "top_k .*torch.float32"),
    ((torch.randn(2, 10), None, torch.ones(2, dtype=torch.float64)), {}, "top_p .*float64"),
    ((torch.randn(2, 10), None, torch.ones(2)), {"num_pivots": 24}, "got 24"),
    ((torch.randn(2, 10), None, torch.ones(2)), {"passes": 0}, "passes .*got 0"),
    ((torch.randn(2, 10), None, torch.ones(2)), {"tiles": (96, 4)}, r"tiles .*\(96, 4\)"),
])
def test_bad_inputs_name_the_value(args, kw, match):
    from kdaserve.kernels.sample.top_p import top_k_top_p_threshold

    with pytest.raises(ValueError, match=match):
        top_k_top_p_threshold(*args, **kw)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

VOCAB = 163840


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B", [1, 4, 16, 33])
def test_threshold_gpu(B):
    for i, kind in enumerate(("normal", "normal8", "ties", "bans", "peaked")):
        x = make_logits(kind, B, VOCAB, "cuda", seed=B + i)
        check_threshold(f"{kind} B={B}", x, *make_settings(_mixed(i, B), VOCAB, "cuda"))
        check_threshold(f"{kind} B={B} top_k only", x,
                        *make_settings(_mixed(i, B), VOCAB, "cuda", use_p=False))
        check_threshold(f"{kind} B={B} top_p only", x,
                        *make_settings(_mixed(i, B), VOCAB, "cuda", use_k=False))
    x = make_logits("normal", B, VOCAB, "cuda", seed=99)
    top_k, top_p = make_settings(_mixed(0, B), VOCAB, "cuda")
    check_threshold(f"int64 top_k B={B}", x, top_k.long(), top_p)
    check_threshold(f"16 pivots x 8 passes B={B}", x, top_k, top_p, num_pivots=16, passes=8)
    for tiles in ((64, 1), (128, 2), (1024, 8)):      # bench_top_p.py's --tiles candidates
        check_threshold(f"tiles {tiles} B={B}", x, top_k, top_p, tiles=tiles)


@pytest.mark.gpu
@gpu
def test_threshold_cuda_graph_gpu():
    """Captured once, replayed with new logits copied into the static input."""
    from kdaserve.kernels.sample.top_p import top_k_top_p_threshold

    B = 16
    x = make_logits("normal", B, VOCAB, "cuda", seed=0)
    top_k, top_p = make_settings(_mixed(0, B), VOCAB, "cuda")
    graph, tau = kc.capture_graph(lambda: top_k_top_p_threshold(x, top_k, top_p))
    for trial, kind in enumerate(("normal8", "peaked", "bans")):
        x.copy_(make_logits(kind, B, VOCAB, "cuda", seed=trial + 1))
        graph.replay()
        torch.cuda.synchronize()
        want = top_k_top_p_threshold(x, top_k, top_p)
        assert torch.equal(tau, want), f"replay {kind} differs from an eager call"
        check_threshold(f"graph replay {kind}", x, top_k, top_p)


if __name__ == "__main__":
    run_interpreter_cases()
    print("top-p interpreter cases passed")
