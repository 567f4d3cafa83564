"""MLA prefill attention of chunks after cached context (the bottom-right aligned causal mask)
and of fresh prompts, at MLA's head dims (qk 192, v 128), against an fp64 softmax written here.
On CUDA both run the in-place kernel (kernels/mla/prefill_attn.py), on the CPU SDPA with and
without a mask (attention/mla_backend.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kdaserve.attention.mla_backend import prefill_attention

H, NOPE, ROPE, V, RANK, BLOCK = 4, 128, 64, 128, 96, 16
QK, LATENT = NOPE + ROPE, RANK + ROPE


def _expected(q, k, v, scale, cached):
    """q: [q_len, H, QK] after `cached` tokens; k, v: [cached + q_len, H, *] -> fp64 out."""
    q_len, kv_len = q.shape[0], k.shape[0]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril(cached).to(q.device)
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v.double())


def _check(device: str, dtype: torch.dtype, bound: float) -> None:
    g = torch.Generator().manual_seed(7)
    # (cached tokens, new tokens) per request: a chunk after context, a fresh prompt, a chunk
    # whose context ends mid-block, a one-token chunk
    reqs = [(300, 200), (0, 150), (45, 61), (77, 1)]
    max_blocks = max(-(-(c + n) // BLOCK) for c, n in reqs)
    kv_cache = torch.randn(len(reqs) * max_blocks, BLOCK, LATENT, generator=g).to(device, dtype)
    perm = torch.randperm(len(reqs) * max_blocks, generator=g)       # scattered blocks
    block_table = perm.view(len(reqs), max_blocks).to(torch.int32).to(device)
    w_k = (torch.randn(RANK, H * NOPE, generator=g) / RANK ** 0.5).to(device, dtype)
    w_v = torch.randn(RANK, H * V, generator=g).to(device, dtype)

    def expand(latent):   # the layer's contract: kv_b's output per head, the rope columns
        c = latent[:, :RANK]
        kv = torch.cat([(c @ w_k).view(-1, H, NOPE), (c @ w_v).view(-1, H, V)], dim=-1)
        return kv, latent[:, RANK:]

    def keys_values(latent):
        kv, pe = expand(latent)
        k = torch.cat([kv[..., :NOPE], pe[:, None].expand(-1, H, ROPE)], dim=-1)
        return k, kv[..., NOPE:]

    qsl = [0]
    for _, n in reqs:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], H, QK, generator=g).to(device, dtype)
    md = SimpleNamespace(query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
                         seq_lens_cpu=torch.tensor([c + n for c, n in reqs], dtype=torch.int32),
                         block_table=block_table, dcp=None)
    out = torch.full((qsl[-1], H, V), float("nan"), device=device, dtype=dtype)
    scale = QK ** -0.5
    prefill_attention(q, kv_cache, md, expand, scale, out, list(range(len(reqs))))
    for i, (cached, n) in enumerate(reqs):
        rows = block_table[i, :max_blocks].long()
        latent = kv_cache[rows].reshape(-1, LATENT)[:cached + n]
        k, v = keys_values(latent)
        want = _expected(q[qsl[i]:qsl[i + 1]], k, v, scale, cached)
        got = out[qsl[i]:qsl[i + 1]].double()
        assert torch.isfinite(got).all(), f"request {i}: rows left unwritten"
        err = ((got - want).norm() / want.norm()).item()
        assert err <= bound, f"request {i} (cached {cached}, new {n}): rel err {err:.2e}"


def test_prefill_chunks_match_fp64_cpu():
    _check("cpu", torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_chunks_match_fp64_gpu():
    _check("cuda", torch.bfloat16, 1e-2)
