"""Triton RecoverSSM / per-position kernels vs their twins (run on CUDA, or on CPU under
TRITON_INTERPRET=1 as a script)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from kdaserve.kernels import reference as ref
from kdaserve.kernels.kda import recover as rc


def _inputs(lens, H, K, V, D, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    # q, k, v as views of one fused projection, like the layer's
    qkv = torch.randn(T, 3, H, K, generator=g).to(dtype)
    q, k, v = qkv.to(device).unbind(1)
    graw = torch.randn(T, H, K, generator=g)
    gate = ref.kda_gate(graw, torch.randn(H, generator=g) * 0.3,
                        torch.randn(H * K, generator=g)).to(device)
    beta = torch.rand(T, H, generator=g).to(device)
    x = torch.randn(T, D, generator=g).to(dtype).to(device)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=device)
    return q, k, v[..., :V], gate, beta, x, cu


def _close(name, out, want, tol):
    err = ((out.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    assert not torch.isnan(out).any(), f"{name}: NaN"
    assert err < tol, f"{name}: rel err {err:.3g} >= {tol}"


def check_recover(device, H=2, K=16, D=24, W=4, dtype=torch.float32, lens=(3, 1, 5, 2), seed=0,
                  tol=1e-5, gate_in_kernel=None, config=None):
    """gate_in_kernel: None (activated g, beta given), "softplus" or "lower_bound" (the kernel
    activates the raw gate and beta logits). config: the verify kernel's launch
    (rc.KDAVerifyConfig, None for the default)."""
    V = K
    lens = list(lens)
    N = len(lens)
    q, k, v, g, beta, x, cu = _inputs(lens, H, K, V, D, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    slots_n = 2 * N + 3
    rec = (torch.randn(slots_n, H, K, V, generator=gen) * 0.5).to(device)
    conv = torch.randn(slots_n, D, W - 1, generator=gen).to(dtype).to(device)
    weight = torch.randn(D, W, generator=gen).to(dtype).to(device)
    slots = torch.randperm(slots_n, generator=gen)[:N].to(torch.int32).to(device)
    rec0, conv0 = rec.clone(), conv.clone()

    gate = None
    g_in, beta_in = g, beta
    if gate_in_kernel is not None:
        gate = rc.KDAGateParams(
            (torch.randn(H, generator=gen) * 0.3).to(device),
            torch.randn(H * K, generator=gen).to(device),
            -5.0 if gate_in_kernel == "lower_bound" else None)
        g_in = torch.randn(sum(lens), H, K, generator=gen).to(dtype).to(device)
        beta_in = torch.randn(sum(lens), H, generator=gen).to(dtype).to(device)
        g = ref.kda_gate(g_in.cpu(), gate.A_log.cpu(), gate.dt_bias.cpu(),
                         gate.lower_bound).to(device)
        beta = torch.sigmoid(beta_in.float())
    o, records = rc.kda_spec_verify(q, k, v, g_in, beta_in, cu, rec, slots, gate=gate,
                                    use_triton=True, config=config)
    y = rc.conv_spec_verify(x, weight, cu, conv, slots, use_triton=True)
    assert torch.equal(rec, rec0) and torch.equal(conv, conv0), "verify wrote the pool"
    o_r, u_r, kh_r = ref.kda_spec_verify(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(),
                                         cu.cpu(), rec0.cpu(), slots.cpu())
    y_r = ref.conv_spec_verify(x.cpu(), weight.cpu(), cu.cpu(), conv0.cpu(), slots.cpu())
    _close("verify o", o.cpu(), o_r, tol if dtype == torch.float32 else 1e-2)
    _close("verify u", records.u.cpu(), u_r, tol if dtype == torch.float32 else 1e-2)
    _close("verify k_hat", records.k_hat.cpu(), kh_r, tol if dtype == torch.float32 else 1e-2)
    _close("verify g", records.g.cpu(), g.cpu(), tol)
    _close("conv verify y", y.cpu().float(), y_r.float(), tol if dtype == torch.float32 else 1e-2)

    for trial in range(3):
        n = torch.tensor([int(torch.randint(0, L + 1, (1,), generator=gen)) for L in lens])
        if trial == 0:
            n = torch.tensor(lens)
        r, cv = rec0.clone(), conv0.clone()
        rc.kda_recover_commit(r, slots, records, cu, n.to(device).to(torch.int32),
                              use_triton=True)
        rc.conv_recover_commit(cv, slots, x, cu, n.to(device).to(torch.int32), use_triton=True)
        r_r, cv_r = rec0.cpu().clone(), conv0.cpu().clone()
        # twin commit from the twin's own records: end-to-end kernel vs twin
        ref.kda_recover_commit(r_r, slots.cpu(), u_r, kh_r, g.cpu(), cu.cpu(), n)
        ref.conv_recover_commit(cv_r, slots.cpu(), x.cpu(), cu.cpu(), n)
        _close(f"commit state n={n.tolist()}", r.cpu(), r_r, tol)
        assert torch.equal(cv.cpu(), cv_r), f"conv commit n={n.tolist()}"


def check_per_position(device, H=2, K=16, D=24, W=4, dtype=torch.float32, lens=(3, 1, 4),
                       seed=3, tol=1e-5, config=None):
    V = K
    lens = list(lens)
    N, C = len(lens), max(lens)
    q, k, v, g, beta, x, cu = _inputs(lens, H, K, V, D, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    slots_n = N * C + 2
    rec = (torch.randn(slots_n, H, K, V, generator=gen) * 0.5).to(device)
    conv = torch.randn(slots_n, D, W - 1, generator=gen).to(dtype).to(device)
    weight = torch.randn(D, W, generator=gen).to(dtype).to(device)
    idx = torch.randperm(slots_n, generator=gen)[:N * C].view(N, C).to(torch.int32).to(device)
    cols = torch.tensor([min(1, L - 1) for L in lens], dtype=torch.int32, device=device)
    r_r, cv_r = rec.cpu().clone(), conv.cpu().clone()
    o, _ = rc.kda_spec_verify(q, k, v, g, beta, cu, rec, idx, initial_cols=cols,
                              per_position=True, use_triton=True, config=config)
    y = rc.conv_spec_verify(x, weight, cu, conv, idx, initial_cols=cols, per_position=True,
                            use_triton=True)
    o_r, _, _ = ref.kda_spec_verify(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), cu.cpu(),
                                    r_r, idx.cpu(), initial_cols=cols.cpu(), per_position=True)
    y_r = ref.conv_spec_verify(x.cpu(), weight.cpu(), cu.cpu(), cv_r, idx.cpu(),
                               initial_cols=cols.cpu(), per_position=True)
    _close("per-position o", o.cpu(), o_r, tol if dtype == torch.float32 else 1e-2)
    _close("per-position y", y.cpu().float(), y_r.float(), tol if dtype == torch.float32 else 1e-2)
    _close("per-position states", rec.cpu(), r_r, tol)
    assert torch.equal(conv.cpu(), cv_r), "per-position conv windows"
    n = torch.tensor(lens, device=device)
    rc.select_per_position([rec, conv], idx, n)
    ref.select_per_position([r_r, cv_r], idx.cpu(), n.cpu())
    _close("select", rec.cpu(), r_r, tol)


def check_conv_verify(device, D=24, W=4, lens=(3, 1, 20, 2), dtype=torch.float32, seed=11,
                      planes=False, tol=1e-5, chunk=8):
    """conv_spec_verify alone: windows longer than the kernel's unrolled chunk and of one
    token, every width (W > 4: the per-token loop), into a [T, D] result or the layer's
    q | k | v planes; the pool is left as it was."""
    lens = list(lens)
    N = len(lens)
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    x = torch.randn(T, D, generator=gen).to(dtype).to(device)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=device)
    conv = torch.randn(2 * N + 1, D, W - 1, generator=gen).to(dtype).to(device)
    weight = torch.randn(D, W, generator=gen).to(dtype).to(device)
    slots = torch.randperm(2 * N + 1, generator=gen)[:N].to(torch.int32).to(device)
    conv0 = conv.clone()
    out = torch.full((3, T, D // 3) if planes else (T, D), float("nan"), dtype=dtype,
                     device=device)
    y = rc.conv_spec_verify(x, weight, cu, conv, slots, use_triton=True, out=out, chunk=chunk)
    assert y is out and torch.equal(conv, conv0), "verify wrote the pool"
    got = out.permute(1, 0, 2).reshape(T, D) if planes else out
    want = ref.conv_spec_verify(x.cpu(), weight.cpu(), cu.cpu(), conv0.cpu(), slots.cpu())
    _close(f"conv verify W={W} lens={lens} planes={planes} chunk={chunk}", got.cpu().float(),
           want.float(), tol if dtype == torch.float32 else 1e-2)


def run_interpreter_suite() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
    from kernel_checks import patch_triton_interpreter

    patch_triton_interpreter()
    check_recover("cpu")
    check_recover("cpu", lens=(1, 2), seed=5)
    check_recover("cpu", seed=6, gate_in_kernel="softplus")
    check_recover("cpu", seed=7, gate_in_kernel="lower_bound")
    check_per_position("cpu")
    # narrower column blocks (windows of 1 token included)
    pre = rc.KDAVerifyConfig(block_v=8, num_warps=2)
    check_recover("cpu", lens=(3, 1, 5, 2), seed=8, config=pre)
    check_recover("cpu", seed=9, gate_in_kernel="lower_bound", config=pre)
    check_per_position("cpu", config=pre)
    for W in (4, 3, 2, 5):
        check_conv_verify("cpu", W=W, planes=W == 4)
    check_conv_verify("cpu", lens=(16, 17, 1), seed=12, planes=True)
    check_conv_verify("cpu", chunk=16, seed=13)             # a window over 2 chunks
    check_conv_verify("cpu", chunk=0, seed=14, planes=True)  # the per-token baseline


if __name__ == "__main__":
    run_interpreter_suite()
    print("recover interpreter suite passed")
