"""RecoverSSM and per-position KDA state modes (CPU twins) against plain sequential runs."""

import pytest
import torch

from kdaserve.kernels import reference as ref

H, K, V, W = 2, 8, 8, 4


def _inputs(lens, seed=0, D=12):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, H, K, generator=g)
    k = torch.randn(T, H, K, generator=g)
    v = torch.randn(T, H, V, generator=g)
    graw = torch.randn(T, H, K, generator=g)
    gate = ref.kda_gate(graw, torch.randn(H, generator=g) * 0.3, torch.randn(H * K, generator=g))
    beta = torch.rand(T, H, generator=g)
    x = torch.randn(T, D, generator=g)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, gate, beta, x, cu


def _pools(num_slots, seed=1, D=12):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_slots, H, K, V, generator=g) * 0.5,
            torch.randn(num_slots, D, W - 1, generator=g))


@pytest.mark.parametrize("seed", range(3))
def test_recover_verify_commit_equals_sequential(seed):
    lens = [4, 1, 3, 5, 2]           # 1 + K_i tokens per request, mixed K
    q, k, v, g, beta, x, cu = _inputs(lens, seed)
    rec, conv = _pools(8, seed + 10)
    weight = torch.randn(12, W, generator=torch.Generator().manual_seed(seed + 20))
    slots = torch.tensor([6, 0, 3, 5, 1], dtype=torch.int32)
    rec0, conv0 = rec.clone(), conv.clone()
    o, u, k_hat = ref.kda_spec_verify(q, k, v, g, beta, cu, rec, slots)
    y = ref.conv_spec_verify(x, weight, cu, conv, slots)
    assert torch.equal(rec, rec0) and torch.equal(conv, conv0)      # verify writes nothing
    c = cu.tolist()
    for i, slot in enumerate(slots.tolist()):
        s, e = c[i], c[i + 1]
        o_ref, _ = ref.kda_recurrent(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], rec0[slot])
        torch.testing.assert_close(o[s:e], o_ref, atol=1e-5, rtol=1e-5)
        y_ref, _ = ref.causal_conv1d(x[s:e], weight, conv0[slot])
        torch.testing.assert_close(y[s:e], y_ref, atol=1e-5, rtol=1e-5)
    # every accept pattern n_i in 0..T_i
    gen = torch.Generator().manual_seed(seed + 30)
    for trial in range(6):
        n = torch.tensor([int(torch.randint(0, L + 1, (1,), generator=gen)) for L in lens])
        if trial == 0:
            n = torch.tensor(lens)
        elif trial == 1:
            n = torch.zeros(len(lens), dtype=torch.long)
        r, cv = rec0.clone(), conv0.clone()
        ref.kda_recover_commit(r, slots, u, k_hat, g, cu, n)
        ref.conv_recover_commit(cv, slots, x, cu, n)
        for i, slot in enumerate(slots.tolist()):
            s, m = c[i], int(n[i])
            if m == 0:
                want, want_conv = rec0[slot], conv0[slot]
            else:
                _, want = ref.kda_recurrent(q[s:s + m], k[s:s + m], v[s:s + m], g[s:s + m],
                                            beta[s:s + m], rec0[slot])
                _, want_conv = ref.causal_conv1d(x[s:s + m], weight, conv0[slot])
            torch.testing.assert_close(r[slot], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cv[slot], want_conv, atol=0, rtol=0)
        untouched = [j for j in range(8) if j not in slots.tolist()]
        assert torch.equal(r[untouched], rec0[untouched])


def test_commit_then_next_step_continues_the_plain_run():
    """Two spec steps with rejections == one plain run over the accepted tokens."""
    q, k, v, g, beta, x, _ = _inputs([9], 5)
    rec, conv = _pools(2, 6)
    weight = torch.randn(12, W)
    slot = torch.tensor([1], dtype=torch.int32)
    rec0, conv0 = rec.clone(), conv.clone()
    # step 1 verifies tokens 0..4 and accepts 2; step 2 verifies tokens 2..6 and accepts 4
    kept = []
    for start, end, n in [(0, 5, 2), (2, 6, 4)]:
        sl = slice(start, end)
        cu1 = torch.tensor([0, end - start], dtype=torch.int32)
        _, u, kh = ref.kda_spec_verify(q[sl], k[sl], v[sl], g[sl], beta[sl], cu1, rec, slot)
        ref.kda_recover_commit(rec, slot, u, kh, g[sl], cu1, torch.tensor([n]))
        ref.conv_recover_commit(conv, slot, x[sl], cu1, torch.tensor([n]))
        kept.extend(range(start, start + n))
    assert kept == list(range(6))
    _, want = ref.kda_recurrent(q[:6], k[:6], v[:6], g[:6], beta[:6], rec0[1])
    _, want_conv = ref.causal_conv1d(x[:6], weight, conv0[1])
    torch.testing.assert_close(rec[1], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(conv[1], want_conv)


@pytest.mark.parametrize("vllm_pointer", [False, True])
def test_per_position_then_select(vllm_pointer):
    lens = [3, 1, 4]
    q, k, v, g, beta, x, cu = _inputs(lens, 7)
    rec, conv = _pools(16, 8)
    weight = torch.randn(12, W)
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], dtype=torch.int32)
    cols = torch.tensor([2, 0, 3]) if vllm_pointer else None
    src = [int(idx[i, 0 if cols is None else cols[i]]) for i in range(3)]
    rec0, conv0 = rec.clone(), conv.clone()
    o, _, _ = ref.kda_spec_verify(q, k, v, g, beta, cu, rec, idx, initial_cols=cols,
                                  per_position=True)
    y = ref.conv_spec_verify(x, weight, cu, conv, idx, initial_cols=cols, per_position=True)
    c = cu.tolist()
    for i in range(3):
        s, e = c[i], c[i + 1]
        for t in range(e - s):
            o_ref, st = ref.kda_recurrent(q[s:s + t + 1], k[s:s + t + 1], v[s:s + t + 1],
                                          g[s:s + t + 1], beta[s:s + t + 1], rec0[src[i]])
            torch.testing.assert_close(rec[idx[i, t]], st, atol=1e-5, rtol=1e-5)
            _, w_ref = ref.causal_conv1d(x[s:s + t + 1], weight, conv0[src[i]])
            assert torch.equal(conv[idx[i, t]], w_ref)
        torch.testing.assert_close(o[s:e], o_ref, atol=1e-5, rtol=1e-5)
        y_ref, _ = ref.causal_conv1d(x[s:e], weight, conv0[src[i]])
        torch.testing.assert_close(y[s:e], y_ref)
    n = torch.tensor([2, 1, 4])
    expect = [rec[idx[i, n[i] - 1]].clone() for i in range(3)]
    ref.select_per_position([rec, conv], idx, n)
    for i in range(3):
        assert torch.equal(rec[idx[i, 0]], expect[i])
    with pytest.raises(ValueError, match="num_accepted"):
        ref.select_per_position([rec], idx, torch.tensor([0, 1, 1]))


def test_commit_rejects_bad_counts():
    q, k, v, g, beta, _, cu = _inputs([2], 0)
    rec, _ = _pools(1)
    slot = torch.tensor([0])
    _, u, kh = ref.kda_spec_verify(q, k, v, g, beta, cu, rec, slot)
    with pytest.raises(ValueError, match="num_accepted"):
        ref.kda_recover_commit(rec, slot, u, kh, g, cu, torch.tensor([3]))
