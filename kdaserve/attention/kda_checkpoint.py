"""Internal KDA checkpoint export: the states at offsets inside a prefill chunk, from the same pass.

`AttentionMetadata.kda_checkpoints` lists, for some requests of the batch, offsets o with
0 < o < query_len: after the forward, checkpoint slot dst must hold that request's KDA state after
its first num_computed + o tokens (exports at o == query_len are the final state: the model runner
copies the slot after the forward, see worker/checkpoints.py). Both halves of the state:

- conv window: the last W-1 raw (pre-conv) q|k|v inputs before the offset. It is read from the
  chunk's own input and the slot's window *before* the conv kernel overwrites the slot
  (`export_conv_windows`, first thing in short_conv), so it is exact on every device.
- recurrent state: the chunked delta rule already computes the state at every chunk start
  (multiples of 64 tokens from the chunk's first token). CPU: `kda_chunk(...,
  return_chunk_states=True)` in fp32, then, for an offset that is not a multiple of 64, the
  token recurrence over the < 64 tokens after the last chunk start. CUDA: fla-core's
  `chunk_kda(..., return_intermediate_states=True)` in the same call that computes the prefill
  (`exporting`), h[chunk] plus, off the 64-token grid, `fused_recurrent_kda` over the remainder.

Precision: fla stores h in k's dtype, so on a bf16 model a GPU internal checkpoint is the fp32
state rounded to bf16 (relative error ~2^-8 per element), where the split baseline keeps the
fp32 final state. The CPU path is fp32 throughout (equal to the split baseline to ~1e-6).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import torch

from kdaserve.attention.metadata import AttentionMetadata
from kdaserve.kernels import reference as ref

CHUNK_SIZE = 64
"""Chunk length of the chunked delta rule (fla-core and the reference): states exist at its
multiples from each sequence start."""


def exports_by_request(md: AttentionMetadata) -> dict[int, list[tuple[int, int]]]:
    """Batch row -> [(offset, dst_slot)] of its internal exports ({} when none)."""
    ckpt = md.kda_checkpoints
    if ckpt is None:
        return {}
    out: dict[int, list[tuple[int, int]]] = {}
    for i, offset, dst in zip(ckpt.req_index, ckpt.offsets, ckpt.dst_slots):
        out.setdefault(i, []).append((offset, dst))
    return out


def export_conv_windows(x: torch.Tensor, md: AttentionMetadata,
                        conv_cache: torch.Tensor) -> None:
    """x: [T, C] raw conv inputs of the batch; conv_cache: [slots, C, W-1]. Writes each export's
    window. Must run before the conv updates the request slots."""
    ckpt = md.kda_checkpoints
    if ckpt is None:
        return
    w1 = conv_cache.shape[-1]
    qsl = md.query_start_loc_cpu.tolist()
    for i, offset, dst in zip(ckpt.req_index, ckpt.offsets, ckpt.dst_slots):
        s = qsl[i]
        slot = md.state_indices[i:i + 1].long()
        init = conv_cache.index_select(0, slot)[0] * md.has_initial_state[i]   # [C, W-1]
        lo = max(0, offset - w1)
        window = torch.cat([init.to(x.dtype), x[s + lo:s + offset].t()], dim=-1)[:, -w1:]
        conv_cache[dst].copy_(window)


def chunk_exporting(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, initial_state: torch.Tensor | None,
                    exports: list[tuple[int, int]], rec_cache: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU: `ref.kda_chunk` over one request's chunk that also writes the state after each
    export offset into rec_cache[dst]. Same inputs and outputs as ref.kda_chunk."""
    o, final, starts = ref.kda_chunk(q, k, v, g, beta, initial_state, chunk_size=CHUNK_SIZE,
                                     return_chunk_states=True)       # starts [NT, H, K, V]
    for offset, dst in exports:
        n, rem = divmod(offset, CHUNK_SIZE)
        state = starts[n]
        if rem:
            a = n * CHUNK_SIZE
            _, state = ref.kda_recurrent(q[a:offset], k[a:offset], v[a:offset], g[a:offset],
                                         beta[a:offset], state)
        rec_cache[dst].copy_(state)
    return o, final


def exporting(chunk_kda: Callable, md: AttentionMetadata, rec_cache: torch.Tensor) -> Callable:
    """CUDA: wrap fla-core's chunk_kda for the prefill rows (md.num_decodes onwards, packed
    with cu_seqlens) so that the same call also writes the internal exports' recurrent states.
    Same signature and result as chunk_kda without intermediate states."""

    def run(q, k, v, g, beta, **kwargs):
        o, final, h = chunk_kda(q, k, v, g, beta, return_intermediate_states=True, **kwargs)
        _write_gpu_exports((q, k, v, g, beta), kwargs, h, md, rec_cache)
        return o, final

    return run


def _write_gpu_exports(inputs, kwargs: dict, h: torch.Tensor, md: AttentionMetadata,
                       rec_cache: torch.Tensor) -> None:
    """h: [1, NT, H, K, V] (k's dtype), the state at every chunk start of every prefill row."""
    from fla.ops.kda import fused_recurrent_kda

    chunk = kwargs.get("chunk_size", CHUNK_SIZE)
    cu = kwargs["cu_seqlens_cpu"].tolist()                    # prefill rows, local offsets
    first_chunk = [0]
    for a, b in pairwise(cu):
        first_chunk.append(first_chunk[-1] + -(-(b - a) // chunk))
    in_kernel = {key: kwargs[key] for key in ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
                                              "A_log", "dt_bias", "lower_bound", "scale")
                 if key in kwargs}
    nd = md.num_decodes
    for i, exports in exports_by_request(md).items():
        r = i - nd
        if r < 0:
            raise RuntimeError(f"internal KDA checkpoint on decode row {i}")
        for offset, dst in exports:
            n, rem = divmod(offset, chunk)
            if n == 0 and kwargs.get("initial_state") is not None:
                state = kwargs["initial_state"][r]             # exact fp32 (h[.., 0] rounds it)
            else:
                state = h[0, first_chunk[r] + n].float()       # [H, K, V]
            if rem:
                a = cu[r] + n * chunk
                # copies, not views at token a: Triton specialises on 16-byte alignment, and a
                # view of beta [1, T, H] (H elements a token) is aligned only at some a
                _, final = fused_recurrent_kda(
                    *(x[:, a:a + rem].clone() for x in inputs), initial_state=state[None],
                    output_final_state=True,
                    use_qk_l2norm_in_kernel=kwargs.get("use_qk_l2norm_in_kernel", False),
                    **in_kernel)
                state = final[0]
            rec_cache[dst].copy_(state)
