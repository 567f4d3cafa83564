"""Internal KDA checkpoint export equals the split baseline: the state after the first o tokens of
a chunk, taken from inside the one pass over the whole chunk, matches running the prefix [0, o)
on its own and taking its final state (<= 1e-5 in fp32), for offsets on and off the 64-token
chunk grid, with and without an initial state."""

from __future__ import annotations

import pytest
import torch

from kdaserve.attention import kda_backend
from kdaserve.attention.builder import build_metadata
from kdaserve.attention.metadata import KDACheckpointRequest
from kdaserve.kernels import reference as ref

H, K, T = 2, 16, 200
OFFSETS = [1, 37, 64, 100, 128, 199]


def _inputs(seed: int, T: int = T, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, H, K, generator=gen) for _ in range(3))
    g = -torch.rand(T, H, K, generator=gen) * 0.3                 # log decay
    beta = torch.rand(T, H, generator=gen)
    init = torch.randn(H, K, K, generator=gen) * 0.1
    return [x.to(device) for x in (q, k, v, g, beta, init)]


def _gate(device):
    class Gate:
        lower_bound = None
        A_log = torch.zeros(1, 1, H, 1, device=device)
        dt_bias = torch.zeros(H * K, device=device)

        def activate(self, g_raw):
            return ref.kda_gate(g_raw, self.A_log, self.dt_bias, None)
    return Gate()


@pytest.mark.parametrize("with_init", [False, True])
def test_chunk_export_equals_split_prefix(with_init):
    from kdaserve.attention.kda_checkpoint import chunk_exporting

    q, k, v, g, beta, init = _inputs(0)
    init = init if with_init else None
    rec = torch.zeros(len(OFFSETS), H, K, K)
    exports = [(off, dst) for dst, off in enumerate(OFFSETS)]
    o, final = chunk_exporting(q, k, v, g, beta, init, exports, rec)
    o_ref, final_ref = ref.kda_chunk(q, k, v, g, beta, init)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)  # the pass itself unchanged
    for dst, off in enumerate(OFFSETS):
        _, split = ref.kda_chunk(q[:off], k[:off], v[:off], g[:off], beta[:off], init)
        err = (rec[dst] - split).abs().max().item()
        assert err <= 1e-5, (off, err)


def _batch_metadata(query_lens, num_computed, slots, exports):
    md = build_metadata(query_lens, num_computed, [[0] * 64 for _ in query_lens], slots, 16,
                        "cpu")
    md.kda_checkpoints = KDACheckpointRequest(
        req_index=[i for i, _, _ in exports], offsets=[o for _, o, _ in exports],
        dst_slots=[d for _, _, d in exports])
    return md


def test_backend_exports_conv_and_recurrent_like_split():
    """Through kda_backend (short_conv + delta_rule) on a two-request batch: a fresh prefill and
    a continued one; exports at several offsets of each land in checkpoint rows."""
    C, W = 3 * H * K, 4
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(150 + 90, C, generator=gen)
    weight = torch.randn(C, W, generator=gen) * 0.5
    conv0 = torch.randn(8, C, W - 1, generator=gen)
    rec0 = torch.randn(8, H, K, K, generator=gen) * 0.1
    exports = [(0, 2, 4), (0, 64, 5), (0, 101, 6), (1, 1, 7), (1, 70, 3)]
    md = _batch_metadata([150, 90], [0, 33], [0, 1], exports)
    conv, rec = conv0.clone(), rec0.clone()
    q, k, v = kda_backend.short_conv(x, weight, md, conv, H, K)
    g_raw = torch.randn(240, H, K, generator=gen)
    b = torch.randn(240, H, generator=gen)
    kda_backend.delta_rule(q, k, v, g_raw, b, _gate("cpu"), md, rec)

    gate = _gate("cpu")
    spans = {0: (0, 150, None, None), 1: (150, 240, conv0[1], rec0[1])}
    for i, off, dst in exports:
        s, _, conv_init, rec_init = spans[i]
        yy, window = ref.causal_conv1d(x[s:s + off], weight, conv_init)
        assert torch.allclose(conv[dst], window, atol=1e-6), (i, off)
        qq, kk, vv = yy.view(-1, 3, H, K).unbind(1)
        _, split = ref.kda_chunk(qq, kk, vv, gate.activate(g_raw[s:s + off]),
                                 torch.sigmoid(b[s:s + off]), rec_init)
        err = (rec[dst] - split).abs().max().item()
        assert err <= 1e-5, (i, off, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 5e-2)])
def test_gpu_internal_export_matches_split(dtype, tol):
    """fla chunk_kda(return_intermediate_states) + remainder recurrence vs a separate chunk_kda
    over the prefix (h is stored in k's dtype: bf16 is checked loosely)."""
    pytest.importorskip("fla")
    from fla.ops.kda import chunk_kda

    from kdaserve.attention.kda_checkpoint import exporting

    dev = "cuda"
    lens, computed = [150, 90], [0, 33]
    exports = [(0, 64, 4), (0, 101, 5), (1, 1, 6), (1, 70, 7)]
    md = _batch_metadata(lens, computed, [0, 1], exports)
    qs, ks, vs, gs, bs, _ = _inputs(2, T=sum(lens), device=dev)
    rec = torch.zeros(8, H, K, K, device=dev)
    init = (torch.randn(2, H, K, K, device=dev) * 0.1) * torch.tensor(
        [0.0, 1.0], device=dev)[:, None, None, None]
    cu = torch.tensor([0, 150, 240], device=dev)
    args = [x.to(dtype)[None].contiguous() for x in (qs, ks, vs)] + [gs[None], bs[None]]
    with torch.inference_mode():
        run = exporting(chunk_kda, md, rec)
        run(*args, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
        for i, off, dst in exports:
            s = int(cu[i])
            _, split = chunk_kda(*(x[:, s:s + off].contiguous() for x in args),
                                 initial_state=init[i:i + 1].contiguous(),
                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
            err = (rec[dst] - split[0]).abs().max().item()
            assert err <= tol * max(1.0, split.abs().max().item()), (i, off, err)
