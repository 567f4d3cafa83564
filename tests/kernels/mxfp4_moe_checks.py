"""Checks of the MXFP4 latent-MoE kernels (kernels/moe/mxfp4_moe.py) against their twins: run on
CUDA (bf16), or as a script on CPU tensors under TRITON_INTERPRET=1 (fp32; test_mxfp4_moe.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_checks as kc  # noqa: E402

from kdaserve.kernels import reference as ref  # noqa: E402
from kdaserve.kernels.mxfp4.format import quantize_mxfp4  # noqa: E402


def _act(name, beta, linear_beta):
    if name == "silu":
        return ref.silu_and_mul
    return lambda g, u: ref.situ_and_mul(g, u, beta, linear_beta)


def _experts(E, D, inter, gen, device):
    # per-row magnitudes spread over several binades: the E8M0 scales differ by block
    def w(n, k):
        mag = torch.exp2(torch.randint(-4, 2, (E, n, 1), generator=gen).float())
        return quantize_mxfp4((torch.randn(E, n, k, generator=gen) * 0.1 * mag).to(device))
    return (*w(2 * inter, D), *w(D, inter))


def check_partials(device="cpu", dtype=torch.float32, N=5, E=8, k=3, D=64, inter=64,
                   act="silu", beta=None, linear_beta=None, bad_id=False, dense=False, seed=0):
    from kdaserve.kernels.mxfp4.format import dequantize_mxfp4
    from kdaserve.kernels.moe.mxfp4_moe import moe_partials

    gen = torch.Generator().manual_seed(seed)
    w13p, w13s, w2p, w2s = _experts(E, D, inter, gen, device)
    x = torch.randn(N, D, generator=gen).to(device, dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)]).to(device)
    if bad_id:
        ids[0, 1] = -1
    fn = _act(act, beta, linear_beta)
    if dense:   # the bf16 baseline: the same weights, dequantised
        w13, w2 = dequantize_mxfp4(w13p, w13s, dtype), dequantize_mxfp4(w2p, w2s, dtype)
        out = moe_partials(x, w13, w2, ids, act=act, beta=beta, linear_beta=linear_beta)
        want = ref.moe_partials(x.float(), lambda e: (w13[e], w2[e]), E, ids, fn)
    else:
        out = moe_partials(x, w13p, w2p, ids, w13s, w2s, act, beta, linear_beta)
        want = ref.moe_partials_mxfp4(x.float(), w13p, w13s, w2p, w2s, ids, fn)
    ok = (ids.reshape(-1) >= 0)
    kc.assert_close(f"{'dense' if dense else 'mxfp4'} partials N={N} {act}", out[ok].float(),
                    want[ok], dtype)


def check_tail(device="cpu", dtype=torch.float32, N=5, k=3, E=8, L=64, H=48, norm=True,
               residual=True, bad_id=False, seed=1):
    from kdaserve.kernels.moe.mxfp4_moe import latent_moe_tail

    gen = torch.Generator().manual_seed(seed)
    partials = torch.randn(N * k, L, generator=gen).to(device, dtype)
    w = torch.rand(N, k, generator=gen).to(device)
    ids = torch.randint(0, E, (N, k), generator=gen).to(device)
    if bad_id:
        ids[-1, 0] = E                      # not local: skipped
        partials[(N - 1) * k] = float("nan")
    up = (torch.randn(H, L, generator=gen) * 0.1).to(device, dtype)
    g = (1 + 0.1 * torch.randn(L, generator=gen)).to(device, dtype) if norm else None
    res = torch.randn(N, H, generator=gen).to(device, dtype) if residual else None
    out = torch.full((N, H), float("nan"), device=device, dtype=dtype)   # poisoned
    latent_moe_tail(partials, w, ids, up, g, 1e-5, res, num_experts=E, out=out)
    want = ref.latent_moe_tail(partials, w, ids, up, g, 1e-5, res, num_experts=E)
    kc.assert_close(f"latent tail N={N} norm={norm} residual={residual}", out.float(),
                    want.float(), dtype)


def check_layer(device="cpu", dtype=torch.float32, N=7, E=8, k=2, L=64, inter=32, H=48, seed=2):
    """partials + tail = the unfused math: moe_experts_mxfp4 (weighted sum), RMSNorm, up."""
    from kdaserve.kernels.moe.mxfp4_moe import latent_moe_tail, moe_partials

    gen = torch.Generator().manual_seed(seed)
    w13p, w13s, w2p, w2s = _experts(E, L, inter, gen, device)
    x = torch.randn(N, L, generator=gen).to(device, dtype)
    logits = torch.randn(N, E, generator=gen).to(device)
    w, ids = ref.moe_topk_sigmoid(logits, torch.zeros(E, device=device), k, True, 2.5)
    up = (torch.randn(H, L, generator=gen) * 0.1).to(device, dtype)
    g = torch.ones(L, device=device, dtype=dtype)
    act = _act("situ", 4.0, 25.0)
    out = latent_moe_tail(moe_partials(x, w13p, w2p, ids, w13s, w2s, "situ", 4.0, 25.0),
                          w, ids, up, g, 1e-5)
    lat = ref.moe_experts_mxfp4(x.float(), w13p, w13s, w2p, w2s, w, ids, act)
    want = ref.rms_norm(lat, g.float(), 1e-5) @ up.float().t()
    kc.assert_close(f"latent MoE layer N={N}", out.float(), want, dtype)


def run_suite(device="cpu", dtype=torch.float32) -> None:
    for N in (1, 5, 40):
        check_partials(device, dtype, N=N)
    check_partials(device, dtype, act="situ", beta=4.0, linear_beta=25.0)
    check_partials(device, dtype, N=1, act="situ", beta=4.0, linear_beta=None, bad_id=True)
    check_partials(device, dtype, N=9, D=96, inter=32, bad_id=True)     # K tails, -1 entries
    for N in (1, 6):
        check_partials(device, dtype, N=N, act="situ", beta=4.0, linear_beta=25.0, dense=True)
    for N, norm, residual in ((1, True, True), (20, True, False), (3, False, True)):
        check_tail(device, dtype, N=N, norm=norm, residual=residual)
    check_tail(device, dtype, N=4, L=80, bad_id=True)
    check_layer(device, dtype)
    check_layer(device, dtype, N=1)


if __name__ == "__main__":
    kc.patch_triton_interpreter()
    torch.manual_seed(0)
    run_suite()
    print("ok")
