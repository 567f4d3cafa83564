"""Checks of the Kimi K3 elementwise / depth kernels against their twins (AttnRes read, SiTU,
the sigmoid output gate, KDA's bounded gate + beta): run on CUDA (bf16), or as a script on CPU
tensors under TRITON_INTERPRET=1 (fp32; test_k3_ops.py). Fresh random inputs per check,
outputs poisoned with NaN first (every element must be written)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_checks as kc  # noqa: E402

kc.patch_triton_interpreter()

from kdaserve.kernels import reference as ref  # noqa: E402


def check_attn_res(device="cpu", dtype=torch.float32, T=5, NB=4, D=96, num_blocks=2,
                   write_idx=-1, delta=True, out_norm=True, pdl=False, seed=0):
    """The read against reference.attn_res in float64: prefix, output, and the blocks (the
    written block equal to the new prefix, the others untouched)."""
    from kdaserve.kernels.attn_res.attn_res import attn_res

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    prefix = rnd(T, D, scale=2.0)
    d = rnd(T, D) if delta else None
    blocks = rnd(T, NB, D, scale=3.0)
    nw = (torch.rand(D, generator=g) + 0.5).to(device, dtype)
    query = rnd(D, scale=D ** -0.5 * 4)           # logits of a few units: a real softmax
    ow = (torch.rand(D, generator=g) + 0.5).to(device, dtype) if out_norm else None
    want_blocks = blocks.clone().double()
    want_p, want = ref.attn_res(prefix.double(), None if d is None else d.double(),
                                want_blocks, nw.double(), query.double(),
                                None if ow is None else ow.double(), num_blocks, write_idx,
                                1e-5)
    got_blocks = blocks.clone()
    if write_idx >= 0:
        got_blocks[:, write_idx] = float("nan")   # must be written
    got_p, got = attn_res(prefix, d, got_blocks, nw, query, ow, num_blocks, write_idx, 1e-5,
                          pdl=pdl)
    name = f"attn_res T={T} NB={NB} D={D} n={num_blocks} w={write_idx}"
    kc.assert_close(name + " out", got, want, dtype)
    kc.assert_close(name + " prefix", got_p, want_p, dtype)
    kc.assert_close(name + " blocks", got_blocks, want_blocks, dtype)
    if d is None:
        assert got_p is prefix, "no delta: the prefix itself comes back"
    untouched = [b for b in range(NB) if b != write_idx]
    assert torch.equal(got_blocks[:, untouched], blocks[:, untouched]), name + " other blocks"
    return got


def check_attn_res_one_source(device="cpu", dtype=torch.float32, seed=0):
    """num_blocks = 0: the output is the (updated) prefix itself, exactly (then normed)."""
    from kdaserve.kernels.attn_res.attn_res import attn_res

    g = torch.Generator().manual_seed(seed)
    prefix = torch.randn(3, 64, generator=g).to(device, dtype)
    blocks = torch.randn(3, 2, 64, generator=g).to(device, dtype)
    w = torch.ones(64, device=device, dtype=dtype)
    _, out = attn_res(prefix, None, blocks, w, w, None, 0, 0, 1e-6)
    assert torch.equal(out, prefix) and torch.equal(blocks[:, 0], prefix)


def check_situ(device="cpu", dtype=torch.float32, T=5, inter=1500, linear_beta=25.0, seed=0):
    from kdaserve.kernels.activation.activation import situ_and_mul

    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(T, 2 * inter + 24, generator=g) * 6).to(device, dtype)
    gate_up = wide[:, 8:8 + 2 * inter]                                    # strided rows
    want = ref.situ_and_mul(gate_up[:, :inter].double(), gate_up[:, inter:].double(), 4.0,
                            linear_beta)
    kc.assert_close(f"situ T={T} I={inter} lb={linear_beta}",
                    situ_and_mul(gate_up, 4.0, linear_beta), want, dtype)


def check_sigmoid_gate(device="cpu", dtype=torch.float32, T=4, n=1100, seed=0):
    from kdaserve.kernels.activation.activation import sigmoid_gate

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, n, generator=g).to(device, dtype)
    gate = (torch.randn(T, n + 30, generator=g) * 3).to(device, dtype)[:, 30:]
    want = ref.sigmoid_gate(x.double(), gate.double())
    got = x.clone()
    assert sigmoid_gate(got, gate) is got
    kc.assert_close(f"sigmoid_gate T={T} n={n}", got, want, dtype)


def check_kda_gate(device="cpu", dtype=torch.float32, T=6, H=3, K=16, seed=0):
    from kdaserve.kernels.kda.gate import kda_gate_beta

    g = torch.Generator().manual_seed(seed)
    extra = 2 * K + H + 5                                  # rows of a wider projection
    proj = (torch.randn(T, H * K + extra, generator=g) * 2).to(device, dtype)
    g_raw = proj[:, :H * K].view(T, H, K)
    b = proj[:, H * K + 2 * K:H * K + 2 * K + H]
    A_log = torch.empty(1, 1, H, 1).uniform_(0.0, 2.7, generator=g).to(device)
    dt_bias = torch.randn(H * K, generator=g).to(device)
    got_g, got_b = kda_gate_beta(g_raw, A_log, dt_bias, -5.0, b)
    want_g = ref.kda_gate(g_raw.double(), A_log.double(), dt_bias.double(), -5.0)
    kc.assert_close(f"kda_gate T={T} H={H} K={K}", got_g, want_g, torch.float32
                    if dtype == torch.float32 else dtype)
    kc.assert_close("kda beta", got_b, torch.sigmoid(b.double()), dtype)
    assert got_g.dtype == torch.float32 and got_b.dtype == torch.float32


def run_all(device="cpu", dtype=torch.float32):
    for i, (T, NB, D, n, w, delta, norm) in enumerate([
            (5, 4, 96, 2, -1, True, True), (1, 3, 64, 0, 0, False, True),
            (3, 4, 200, 2, 2, True, True), (7, 3, 48, 3, -1, True, False),
            (2, 5, 130, 1, 4, True, True)]):
        check_attn_res(device, dtype, T, NB, D, n, w, delta, norm, seed=i)
    check_attn_res_one_source(device, dtype)
    check_situ(device, dtype)
    check_situ(device, dtype, T=2, inter=40, linear_beta=None, seed=1)
    check_sigmoid_gate(device, dtype)
    check_kda_gate(device, dtype)
    check_kda_gate(device, dtype, T=2, H=5, K=250, seed=1)   # columns over several blocks


if __name__ == "__main__":
    run_all()
    print("ok")
