"""MLA over the paged latent cache ([c | k_pe] per token).

Decodes (the first num_decodes requests) and speculative verification rows (md.mla_absorbed, one
row per window token) use the absorbed form: queries are mapped into the latent space with W_UK,
attention runs directly over the cached latents, and the latent output is mapped back with W_UV.
Prefill chunks expand their whole context (cached prefix + new tokens) with kv_b_proj and run
causal attention whose mask is aligned to the bottom-right (query i sits at position
num_computed_tokens + i). With decode context parallelism (md.dcp) the cache holds this rank's
shard of each context: absorbed rows merge the shards' partial attention by their lse, prefill
chunks all-gather their context's latents first (attention/dcp.py).
"""

from __future__ import annotations

import torch

from kdaserve.attention import dcp as dcp_attn
from kdaserve.attention.dcp import DCPGroup
from kdaserve.attention.metadata import AttentionMetadata
from kdaserve.kernels import reference as ref
from kdaserve.kernels.mla.prefill_attn import mla_prefill_attention


def store_latent(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, ckv: torch.Tensor,
                 norm_weight: torch.Tensor, eps: float, pdl: bool = False) -> None:
    """kv_cache: [num_blocks, block_size, D]; slot_mapping: [T]; ckv: [T, D] = [c | k_pe] before
    the kv_a norm (applied to c here, fused into the store on CUDA)."""
    if ckv.is_cuda:
        from kdaserve.kernels.mla.decode import store_latent as store

        store(kv_cache, slot_mapping, ckv, norm_weight, eps, pdl=pdl)
    else:
        ref.store_latent(kv_cache, slot_mapping, ckv, norm_weight, eps)


def absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                       block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                       pdl: bool = False, prefetch_kv: bool = False,
                       dcp: DCPGroup | None = None, rows_per_seq: int = 1,
                       fold: bool = False) -> torch.Tensor:
    """One query row per (block_table, seq_lens) row, attending to the first seq_lens[i]
    cached latents: q_nope [R, H, rank] (W_UK applied), q_pe [R, H, rope] -> [R, H, rank].
    The CUDA kernel reads the two strided inputs directly (no concatenation). prefetch_kv:
    see kernels/mla/decode.py mla_decode (the previous launch must not write the cache).
    dcp: the context is sharded over the group and seq_lens are this rank's local lengths
    (attention/dcp.py: queries gathered, local attention, partials merged by their lse).
    rows_per_seq > 1: every run of that many rows is one sequence's verify window; the CUDA
    kernel splits the context by sequences, and with fold takes 2 rows of a window as one
    program (kernels/mla/decode.py fold_config). Not with dcp, whose path keeps one row a
    program."""
    rank = q_nope.shape[-1]
    if dcp is not None:
        return dcp_attn.absorbed_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, scale,
                                           dcp, pdl=pdl)
    if q_nope.is_cuda:
        from kdaserve.kernels.mla.decode import fold_config, mla_decode

        config = fold_config(q_nope.shape[1], q_nope.dtype) if fold and rows_per_seq > 1 \
            else None
        return mla_decode(q_nope, kv_cache, block_table, seq_lens, scale, rank, q_pe=q_pe,
                          pdl=pdl, prefetch_kv=prefetch_kv and config is None,
                          rows_per_seq=rows_per_seq, config=config)
    q_latent = torch.cat([q_nope, q_pe], dim=-1)                          # [R, H, rank + rope]
    return ref.mla_decode(q_latent, kv_cache, block_table, seq_lens, scale, rank)


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                      expand, scale: float, out: torch.Tensor, reqs: list[int]) -> None:
    """Causal attention of the prefill chunks of requests `reqs` over their cached context plus
    their new tokens, written into their rows of `out`.

    q: [T, H, qk_head_dim] and out: [T, H, v_head_dim] for the whole batch; expand(latent
    [L, D]) -> (kv [L, H, nope + v_head_dim]: kv_b_proj's output, k_pe [L, rope])."""
    qsl = md.query_start_loc_cpu.tolist()
    seq_lens = md.seq_lens_cpu.tolist()
    if md.dcp is not None:   # the context is sharded: one all-gather of every chunk's latents
        rows = torch.tensor(reqs, dtype=torch.long, device=md.block_table.device)
        gathered = dcp_attn.gather_latents(kv_cache, md.block_table[rows],
                                           [seq_lens[i] for i in reqs], md.dcp.group)
        latents = dict(zip(reqs, gathered))
    for i in reqs:
        s, e = qsl[i], qsl[i + 1]
        if md.dcp is not None:
            latent = latents[i]                                              # [L, D]
        else:
            latent = ref.paged_gather(kv_cache, md.block_table[i], seq_lens[i])   # [L, D]
        kv, k_pe = expand(latent)
        if q.is_cuda and q.dtype != torch.float32:
            # k and v read in place from kv_b's output and the rope columns
            mla_prefill_attention(q[s:e], kv, k_pe, scale, out=out[s:e])
        else:   # the CPU, and fp32 on CUDA (the kernel's exact fp32 dots are slow)
            out[s:e] = ref.mla_prefill_attention(q[s:e], kv, k_pe, scale)
