"""Checks of the MXFP4 latent-MoE kernels (kernels/moe/mxfp4_moe.py) against their twins: run on
CUDA (bf16), or as a script on CPU tensors under TRITON_INTERPRET=1 (fp32; test_mxfp4_moe.py)."""

from __future__ import annotations

import itertools
import sys
import warnings
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


def _same_bits(out: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal NaN positions, and bit-identical values elsewhere (so -0.0 != 0.0)."""
    bits = torch.int16 if out.dtype == torch.bfloat16 else torch.int32
    nan = torch.isnan(want)
    return (torch.equal(torch.isnan(out), nan)
            and torch.equal(out[~nan].view(bits), want[~nan].view(bits)))


def check_decode_exact(device="cpu", dtype=torch.float32):
    """The GEMMs' weight decode (mxfp4_decode_probe.py; bit decode and table lookups) equals
    format.py dequantize_mxfp4 bit for bit: every E2M1 code under every E8M0 byte, 0 (2^-127)
    and 255 (NaN) included, in both nibbles; tiles of 32, 64 and 128 along K; row and K tails
    masked. bf16 on a GPU only:
    the interpreter's fp32 -> bf16 cast mishandles fp32 subnormals (scale byte 0)."""
    from mxfp4_decode_probe import mxfp4_decode_probe_kernel

    from kdaserve.kernels.moe.mxfp4_moe import _lut_table_words
    from kdaserve.kernels.mxfp4.format import dequantize_mxfp4

    gen = torch.Generator().manual_seed(3)
    # expert 0, row n: the 256 byte values (every low / high code pair), every scale byte n;
    # expert 1: random bytes, a different random scale byte per group of 32 K values
    packed = torch.stack([torch.arange(256).repeat(256, 1),
                          torch.randint(0, 256, (256, 256), generator=gen)]).to(torch.uint8)
    scale = torch.stack([torch.arange(256)[:, None].expand(256, 16),
                         torch.randint(0, 256, (256, 16), generator=gen)]).to(torch.uint8)
    packed, scale = packed.to(device), scale.to(device)          # [2, 256, 256], [2, 256, 16]
    table = _lut_table_words(torch.device(device))
    want0 = dequantize_mxfp4(packed[0], scale[0]).double()
    assert (want0 == 0).any() and torch.isinf(want0).any() and torch.isnan(want0).any()
    assert (want0.abs() == 2.0 ** -128).any() and torch.signbit(want0[want0 == 0]).any()
    for n_rows, half_k in ((256, 256), (250, 240)):              # (250, 240): both tails
        w, s = packed[:, :n_rows, :half_k], scale[:, :n_rows, :half_k // 16]
        for (block_n, block_k), lut in itertools.product(((16, 32), (64, 64), (128, 128)),
                                                         (False, True)):
            for e in range(2):
                out = torch.full((n_rows, 2 * half_k), 12345.0, device=device, dtype=dtype)
                with warnings.catch_warnings():     # NumPy under the interpreter: inf products
                    warnings.simplefilter("ignore", RuntimeWarning)
                    mxfp4_decode_probe_kernel[(-(-n_rows // block_n),)](
                        w, s, out, table, e, n_rows, half_k, w.stride(0), w.stride(1),
                        s.stride(0), s.stride(1), out.stride(0), BLOCK_N=block_n,
                        BLOCK_K=block_k, LUT=lut)
                want = dequantize_mxfp4(w[e], s[e], dtype)
                assert _same_bits(out, want), (f"decode {dtype} expert {e} rows {n_rows} "
                                               f"K {2 * half_k} tiles {block_n}x{block_k}")


def check_lut_probe(device="cpu", block=256, warps=4):
    """The GEMV's byte-permute decode (_e2m1_pair_lut through mxfp4_decode_probe.py, its table
    words read from memory as the GEMV reads them) gives every byte's low and high E2M1 values
    bit for bit, -0.0 for code 8 included, with each byte value in each position of its
    four-byte group. On the CPU the PTX runs through kernel_checks' model of it."""
    from mxfp4_decode_probe import mxfp4_lut_probe_kernel

    from kdaserve.kernels.moe.mxfp4_moe import _lut_table_words
    from kdaserve.kernels.mxfp4.format import E2M1_VALUES

    codes = torch.arange(256, dtype=torch.uint8).repeat(4)
    codes = torch.cat([codes, codes.roll(1), codes.roll(2), codes.roll(3)]).to(device)
    lo = torch.full((codes.numel(),), 12345.0, device=device)
    hi = torch.full_like(lo, 12345.0)
    mxfp4_lut_probe_kernel[(codes.numel() // block,)](
        codes, lo, hi, _lut_table_words(torch.device(device)), codes.numel(), BLOCK=block,
        num_warps=warps)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    want_lo, want_hi = table[(codes.cpu() & 15).long()], table[(codes.cpu() >> 4).long()]
    assert _same_bits(lo.cpu(), want_lo), f"low nibbles, block {block}"
    assert _same_bits(hi.cpu(), want_hi), f"high nibbles, block {block}"


def check_partials(device="cpu", dtype=torch.float32, N=5, E=8, k=3, D=64, inter=64,
                   act="silu", beta=None, linear_beta=None, bad_id=False, dense=False, seed=0,
                   config=None):
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
        out = moe_partials(x, w13, w2, ids, act=act, beta=beta, linear_beta=linear_beta,
                           config=config)
        want = ref.moe_partials(x.float(), lambda e: (w13[e], w2[e]), E, ids, fn)
    else:
        out = moe_partials(x, w13p, w2p, ids, w13s, w2s, act, beta, linear_beta, config)
        want = ref.moe_partials_mxfp4(x.float(), w13p, w13s, w2p, w2s, ids, fn)
    ok = (ids.reshape(-1) >= 0)
    kc.assert_close(f"{'dense' if dense else 'mxfp4'} partials N={N} {act}", out[ok].float(),
                    want[ok], dtype)


def check_tail(device="cpu", dtype=torch.float32, N=5, k=3, E=8, L=64, H=48, norm=True,
               residual=True, bad_id=False, seed=1, config=None):
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
    latent_moe_tail(partials, w, ids, up, g, 1e-5, res, num_experts=E, out=out, config=config)
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


def check_dispatch() -> None:
    """default_config by shape: kimi-k3-mini's decode step (one token and a batch of 64) on
    the decode tiles (the tail in its GEMV form below 16 tokens), its 8000-token prefill on the
    prefill tiles; the suite's shapes below land in the class each of them is there for."""
    from kdaserve.kernels.moe.mxfp4_moe import (GEMM_CLASSES, TAIL_CLASSES, Mxfp4MoEConfig,
                                                default_config)

    assert default_config(1, 16, 256) == default_config(15, 16, 256) == Mxfp4MoEConfig()
    for (N, k, E), gemm, tail in (((1, 16, 256), 0, 0), ((64, 16, 256), 0, 1),
                                  ((8000, 16, 256), 2, 3), ((20, 3, 8), 0, 1),
                                  ((4, 3, 8), 0, 0), ((48, 2, 4), 1, 1), ((520, 2, 4), 2, 3),
                                  ((200, 2, 4), 1, 2), ((600, 2, 4), 2, 3)):
        got = vars(default_config(N, k, E))
        want = {**GEMM_CLASSES[gemm][1], **TAIL_CLASSES[tail][1]}
        assert {f: got[f] for f in want} == want, (N, k, E, got)
        assert got["block_m"] > 1, "the GEMV form (block_m = 1) is opt-in only"


def run_suite(device="cpu", dtype=torch.float32) -> None:
    from kdaserve.kernels.moe.mxfp4_moe import GEMM_CLASSES, Mxfp4MoEConfig

    check_decode_exact(device, dtype)
    check_dispatch()
    for N in (1, 5, 40):
        check_partials(device, dtype, N=N)
    check_partials(device, dtype, act="situ", beta=4.0, linear_beta=25.0)
    check_partials(device, dtype, N=1, act="situ", beta=4.0, linear_beta=None, bad_id=True)
    check_partials(device, dtype, N=9, D=96, inter=32, bad_id=True)     # K tails, -1 entries
    for N in (1, 6):
        check_partials(device, dtype, N=N, act="situ", beta=4.0, linear_beta=25.0, dense=True)
    for N, norm, residual in ((1, True, True), (20, True, False), (3, False, True)):
        check_tail(device, dtype, N=N, norm=norm, residual=residual)
    check_tail(device, dtype, N=4, L=80, bad_id=True)                 # GEMV form, unshrunk
    check_tail(device, dtype, N=3, k=5, L=300, H=40, seed=9)           # K and N tails, odd k
    check_layer(device, dtype)
    check_layer(device, dtype, N=1)
    # the larger classes unshrunk (D, I >= 128, H >= 256) with several row blocks per expert:
    # 48 tokens x 2 of 4 experts ~ 24 rows each (the 64-row class); 520 x 2 of 4 ~ 260 rows
    # each, 3 blocks of 128 (the prefill class, and the atomic alignment: > 1024 entries)
    check_partials(device, dtype, N=48, E=4, k=2, D=128, inter=128, act="situ", beta=4.0,
                   linear_beta=25.0)
    check_partials(device, dtype, N=48, E=4, k=2, D=128, inter=128, dense=True, seed=8)
    check_partials(device, dtype, N=520, E=4, k=2, D=128, inter=128, act="situ", beta=4.0,
                   linear_beta=25.0, bad_id=True)
    check_partials(device, dtype, N=520, E=4, k=2, D=160, inter=160, seed=3)  # N and K tails
    check_partials(device, dtype, N=520, E=4, k=2, D=128, inter=128, act="situ", beta=4.0,
                   linear_beta=25.0, dense=True, seed=4)
    # forced through config=: 300 tokens on both of 2 experts, 3 blocks of 128 rows each
    # (one partial), with the one-launch alignment (600 entries)
    prefill = Mxfp4MoEConfig(**GEMM_CLASSES[-1][1])
    check_partials(device, dtype, N=300, E=2, k=2, D=128, inter=128, config=prefill, seed=5)
    check_tail(device, dtype, N=200, k=2, L=80, H=300, bad_id=True)                # 32 x 128
    check_tail(device, dtype, N=600, k=2, L=80, H=300, residual=False, seed=6)     # 64 x 256
    check_layer(device, dtype, N=520, E=4, k=2, L=128, inter=128, H=300, seed=7)
    check_gemv_form(device, dtype)
    if device == "cpu":
        check_lut_probe()
        check_lut_decode()


def check_gemv_form(device="cpu", dtype=torch.float32) -> None:
    """The GEMV form of the expert GEMMs (block_m = 1, through config=): MXFP4 and dense, silu
    and SiTU (up branch clipped and not), one token and several, -1 entries, K tails (D = 96:
    a half-empty last chunk of 64; D = I = 160 at 128: N and K tails), block_n below the
    tl.dot minimum, and GEMM_GEMV's tiles unshrunk (D = I = 256)."""
    from kdaserve.kernels.moe.mxfp4_moe import GEMM_GEMV, Mxfp4MoEConfig

    gemv = Mxfp4MoEConfig(block_m=1, block_n=16, block_k=64, num_warps=4, num_stages=2)
    situ = dict(act="situ", beta=4.0)
    for dense in (False, True):
        for N, kw in ((1, {}), (5, dict(situ, linear_beta=25.0)),
                      (1, dict(situ, linear_beta=None, bad_id=True)), (5, dict(bad_id=True))):
            check_partials(device, dtype, N=N, dense=dense, config=gemv, seed=10 + N, **kw)
        check_partials(device, dtype, N=5, D=96, inter=32, bad_id=True, dense=dense,
                       config=gemv, seed=12)
        check_partials(device, dtype, N=3, D=160, inter=160, dense=dense, seed=13,
                       config=Mxfp4MoEConfig(block_m=1, block_n=64, block_k=128), **situ,
                       linear_beta=25.0)
    check_partials(device, dtype, N=2, config=Mxfp4MoEConfig(block_m=1, block_n=8, block_k=32),
                   seed=14)
    check_partials(device, dtype, N=1, D=256, inter=256, config=Mxfp4MoEConfig(**GEMM_GEMV),
                   seed=15, **situ, linear_beta=25.0)


def check_lut_decode() -> None:
    """bf16 activations on the CPU, where the expert GEMMs take the table-lookup decode (its
    PTX through kernel_checks' model of it) or, lut_decode off, the bit decode: the tl.dot
    form at its decode and 64-row classes (K tails, -1 entries), then the GEMV form at one
    token and several, SiTU, -1 entries, K tails (D = 96 at block_k 64), block_n 8 and
    GEMM_GEMV's tiles unshrunk."""
    from kdaserve.kernels.moe.mxfp4_moe import GEMM_CLASSES, GEMM_GEMV, Mxfp4MoEConfig

    bf16 = torch.bfloat16
    for lut in (True, False):
        for rows, seed in ((0, 25), (16, 26)):   # the decode and 64-row tl.dot classes
            tiles = Mxfp4MoEConfig(**dict(GEMM_CLASSES)[rows], lut_decode=lut)
            check_partials("cpu", bf16, N=5 if rows == 0 else 48, E=4, k=2, D=96,
                           inter=128, act="situ", beta=4.0, linear_beta=25.0, bad_id=True,
                           config=tiles, seed=seed)
        gemv = Mxfp4MoEConfig(block_m=1, block_n=16, block_k=64, num_warps=4, num_stages=2,
                              lut_decode=lut)
        check_partials("cpu", bf16, N=1, config=gemv, seed=20)
        check_partials("cpu", bf16, N=3, config=gemv, act="situ", beta=4.0, linear_beta=25.0,
                       bad_id=True, seed=21)
        check_partials("cpu", bf16, N=2, D=96, inter=32, config=gemv, seed=22)
        check_partials("cpu", bf16, N=2, seed=23,
                       config=Mxfp4MoEConfig(block_m=1, block_n=8, block_k=32, lut_decode=lut))
    check_partials("cpu", bf16, N=1, D=256, inter=256, seed=24, act="situ", beta=4.0,
                   config=Mxfp4MoEConfig(**GEMM_GEMV))


if __name__ == "__main__":
    kc.patch_triton_interpreter()
    torch.manual_seed(0)
    run_suite()
    print("ok")
