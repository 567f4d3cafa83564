"""Checks of the one-token MoE path (kdaserve.kernels.moe.single_token) against
`reference.moe_experts`; run on CUDA, or as a script on CPU under TRITON_INTERPRET=1 (fp32),
started by test_moe_single_token.py in a subprocess.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_checks as kc  # noqa: E402

# Kimi-Linear-48B: 256 routed experts + the shared one folded in as id 256 (weight 1), k = 8 + 1
E48, D48, I48, K48 = 257, 2304, 1024, 9


def make_weights(device, dtype, num_experts, hidden, inter, seed=0):
    """w13 [E, 2I, D], w2 [E, D, I] with unit-scale outputs."""
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device)
           * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g, device=device)
          * inter ** -0.5).to(dtype)
    return w13, w2


def make_token(device, dtype, hidden, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(1, hidden, generator=g, device=device).to(dtype)          # [1, D]


def random_routing(device, num_experts, top_k, seed=0):
    """ids drawn with repeats allowed (any k), weights in (0, 1]; fp32 [1, k], int32 [1, k]."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, num_experts, (1, top_k), generator=g, device=device).int()
    weights = torch.rand(1, top_k, generator=g, device=device) + 0.05
    return weights, ids


def model_routing(device, seed=0):
    """The 48B decode routing: sigmoid top-8 of 256 routed experts, then the shared expert."""
    weights, ids = kc.make_routing(device, 1, E48 - 1, K48 - 1, seed=seed)
    shared_w = torch.ones(1, 1, device=device)
    shared_id = torch.full((1, 1), E48 - 1, dtype=torch.int32, device=device)
    return torch.cat([weights, shared_w], 1), torch.cat([ids, shared_id], 1)


def reference(x, w13, w2, weights, ids, gather=False):
    """fp64 `moe_experts` with ids outside [0, E) dropped. gather=True runs it on the k touched
    experts only (one local expert per entry: the same sum, without casting all E to fp64)."""
    from kdaserve.kernels import reference as ref

    E = w13.shape[0]
    keep = (ids >= 0) & (ids < E)
    w = torch.where(keep, weights.float(), 0.0)
    ids_c = ids.long().clamp(0, E - 1)
    if gather:
        local = torch.arange(ids.shape[1], device=ids.device)[None]
        return ref.moe_experts(x.double(), w13[ids_c[0]].double(), w2[ids_c[0]].double(), w,
                               local)
    return ref.moe_experts(x.double(), w13.double(), w2.double(), w, ids_c)


def run_single(x, w13, w2, weights, ids, config=None):
    """The kernel into a NaN-poisoned out (unwritten columns show up)."""
    from kdaserve.kernels.moe.single_token import fused_moe_single_token

    out = torch.full_like(x, float("nan"))
    got = fused_moe_single_token(x, w13, w2, weights, ids, out=out, config=config)
    assert got is out, "the result must be written into out"
    return out


def check_single(name, x, w13, w2, weights, ids, bound, config=None, gather=False):
    out = run_single(x, w13, w2, weights, ids, config)
    assert not torch.isnan(out).any(), f"{name}: NaN in output"
    err = kc.rel_err(out, reference(x, w13, w2, weights, ids, gather))
    assert err <= bound, f"{name}: relative error {err:.3e} > {bound:.0e}"
    return out


def check_vs_fused(x, w13, w2, weights, ids, bound=1e-2):
    """Same inputs through the current fused_moe (DIRECT mode at N = 1)."""
    from kdaserve.kernels.moe.fused_moe import fused_moe

    single = run_single(x, w13, w2, weights, ids)
    fused = fused_moe(x, w13, w2, weights, ids)
    err = kc.rel_err(single, fused)
    assert err <= bound, f"single vs fused_moe: relative error {err:.3e} > {bound:.0e}"


def run_interpreter_suite() -> None:
    from kdaserve.kernels.moe.single_token import GemvConfig, SingleTokenMoEConfig

    kc.patch_triton_interpreter()
    E, D, I = 8, 64, 48
    f32 = torch.float32
    w13, w2 = make_weights("cpu", f32, E, D, I)
    x = make_token("cpu", f32, D, seed=1)
    configs = [None,                                                  # default, fitted
               SingleTokenMoEConfig(GemvConfig(16, 32, 4, 1), GemvConfig(16, 32, 4, 1)),
               SingleTokenMoEConfig(GemvConfig(32, 16, 2, 1), GemvConfig(32, 64, 2, 1))]
    for k, bad_id in ((3, E), (9, -1)):        # k = 9 > E: repeated ids
        weights, ids = random_routing("cpu", E, k, seed=k)
        ids[0, 1] = bad_id
        weights[0, 1] = float("inf")           # a dropped entry's weight is never read
        for cfg in configs:
            check_single(f"k={k} cfg={cfg}", x, w13, w2, weights, ids, 1e-5, cfg)
        check_single(f"k={k} int64 ids", x, w13, w2, weights, ids.long(), 1e-5)
        check_single(f"k={k} gathered reference", x, w13, w2, weights, ids, 1e-5, gather=True)
    weights, ids = random_routing("cpu", E, 4, seed=7)
    from kdaserve.kernels.moe.single_token import fused_moe_single_token
    a = fused_moe_single_token(x, w13, w2, weights, ids)                  # out=None path
    assert a.shape == (1, D) and a.dtype == f32
    assert kc.rel_err(a, reference(x, w13, w2, weights, ids)) <= 1e-5, "out=None path"
    ids[0] = -1                                                           # nothing routed
    z = fused_moe_single_token(x, w13, w2, weights, ids)
    assert torch.equal(z, torch.zeros_like(z)), "all ids dropped must give zeros"


if __name__ == "__main__":
    run_interpreter_suite()
    print("ok")
