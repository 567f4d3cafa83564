"""Decode context parallelism (DCP): MLA's latent KV sharded along the sequence over a group of
ranks, and the attention that runs over the shards.

Under tensor parallelism every rank would hold the whole latent KV (it has no head dimension to
shard). With DCP the `size` ranks of a group (a sub-group of the TP group: consecutive TP ranks)
each keep only the positions p with `(p // interleave) % size == rank`, vLLM's layout
(vLLM's `--dcp-kv-cache-interleave-size`, our dcp_kv_cache_interleave_size; 1 = token round
robin, block_size = whole blocks).

Cache layout. The scheduler counts *logical* blocks of `size * block_size` tokens; a block id in a
request's block table names the same physical block on every rank of the group, and on rank r
that block holds the block_size positions of the logical block that r owns, in position order.
Rank r's own positions therefore form one contiguous local sequence: position p sits at local
index `(p // (interleave * size)) * interleave + p % interleave`, in block `index // block_size`
of the request's table at offset `index % block_size` (block_size must be a multiple of
interleave: EngineConfig checks it). The decode kernel runs unchanged over a rank's shard with the local lengths
(`local_len`); other ranks' tokens get slot -1 (not stored). KDA state is not sharded by DCP.

Attention. Absorbed rows (decodes): each rank all-gathers the group's query heads, attends with
all of them over its shard (output and log-sum-exp per query), and an all-to-all hands every rank
the partials of its own heads from every shard, merged by their lse (kernels/mla/merge.py).
Prefill chunks expand their context with this rank's heads of kv_b_proj, so they all-gather the
latent rows of the context from the shards instead (`gather_latents`) and run as without DCP:
the rows are small (kv_lora_rank + rope values per token), and the weights of other ranks' heads
are not here to expand them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kdaserve.distributed.comm import GroupComm
from kdaserve.kernels import reference as ref


@dataclass(frozen=True)
class DCPGroup:
    """This rank's place in its DCP group, the sequence layout, and the group's collectives."""

    size: int
    rank: int
    interleave: int = 1
    comm: GroupComm | None = None
    """The DCP ranks' collectives (distributed/comm.py; ParallelState.dcp). None: layout only
    (metadata tests)."""

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"DCP rank {self.rank} outside a group of size {self.size}")
        if self.interleave < 1:
            raise ValueError(f"dcp_kv_cache_interleave_size must be >= 1, got {self.interleave}")
        if self.comm is not None and (self.comm.size, self.comm.rank) != (self.size, self.rank):
            raise ValueError(f"DCP rank {self.rank}/{self.size} but its group is {self.comm}")

    @classmethod
    def of(cls, comm: GroupComm, interleave: int) -> "DCPGroup":
        return cls(comm.size, comm.rank, interleave, comm)

    # ---- layout (numpy or python ints) ----
    def owner(self, pos):
        """The DCP rank that stores position pos."""
        return (pos // self.interleave) % self.size

    def local_index(self, pos):
        """Index of position pos in its owner's local sequence."""
        i = self.interleave
        return (pos // (i * self.size)) * i + pos % i

    def local_len(self, lens, rank: int | None = None):
        """How many of positions [0, lens) rank `rank` (default this one) stores."""
        r = self.rank if rank is None else rank
        i, n = self.interleave, self.size
        full = lens // (i * n)
        rest = lens - full * i * n
        return full * i + np.clip(rest - r * i, 0, i)

    # ---- collectives over the group ----
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[...] from each rank -> [size, ...] in rank order."""
        return self.comm.all_gather(x, dim=0).view(self.size, *x.shape)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [size, ...]: x[j] goes to rank j; returns [size, ...] with row j from rank j."""
        return self.comm.all_to_all(x)


def slot_mapping(table: np.ndarray, req: np.ndarray, pos: np.ndarray, block_size: int,
                 dcp: DCPGroup) -> np.ndarray:
    """Flat latent-KV slot on this rank of each token (req[i], pos[i]): -1 for tokens another
    rank stores. table: [num_reqs, W] logical block ids -> int64 [num_tokens]."""
    local = dcp.local_index(pos)
    slots = table[req, local // block_size].astype(np.int64) * block_size + local % block_size
    return np.where(dcp.owner(pos) == dcp.rank, slots, -1)


@dataclass
class DCPMetadata:
    """The DCP part of one step's metadata (AttentionMetadata.dcp)."""

    group: DCPGroup
    local_seq_lens: torch.Tensor      # [num_reqs] int32, device: this rank's share of seq_lens


def _attend_with_lse(q, kv_cache, block_table, seq_lens, scale: float, rank: int, pdl: bool):
    if q.is_cuda:
        from kdaserve.kernels.mla.decode import mla_decode

        return mla_decode(q, kv_cache, block_table, seq_lens, scale, rank, pdl=pdl,
                          return_lse=True)
    return ref.mla_decode(q, kv_cache, block_table, seq_lens, scale, rank, return_lse=True)


def _merge(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    if outs.is_cuda:
        from kdaserve.kernels.mla.merge import merge_attn_states

        return merge_attn_states(outs, lses, return_lse=False)
    return ref.merge_attn_states(outs, lses)[0]


def absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                       block_table: torch.Tensor, local_seq_lens: torch.Tensor, scale: float,
                       dcp: DCPGroup, pdl: bool = False) -> torch.Tensor:
    """Absorbed rows over the group's shards: q_nope [R, H, rank] and q_pe [R, H, rope] are
    this rank's heads; local_seq_lens [R] this rank's share of each row's context. Returns the
    latent output of this rank's heads [R, H, rank] in q_nope.dtype, equal to attention over
    the whole context.

    The partials travel as fp32 [out | lse] rows in one all-to-all (an exact merge whatever the
    model dtype); a shard with none of a row's keys sends lse -inf and weighs nothing."""
    R, H, rank = q_nope.shape
    n = dcp.size
    q = torch.cat([q_nope, q_pe], dim=-1)                                # [R, H, rank + rope]
    q_all = dcp.all_gather(q).permute(1, 0, 2, 3).reshape(R, n * H, -1)  # [R, n*H, rank + rope]
    out, lse = _attend_with_lse(q_all, kv_cache, block_table, local_seq_lens, scale, rank,
                                pdl)                                     # [R, n*H, rank], [R, n*H]
    packed = torch.cat([out.float(), lse[..., None]], dim=-1)            # [R, n*H, rank + 1]
    send = packed.view(R, n, H, rank + 1).transpose(0, 1)                # [n, R, H, rank + 1]
    recv = dcp.all_to_all(send)                  # [n, R, H, rank + 1]: shard j's partial, my heads
    return _merge(recv[..., :rank], recv[..., rank]).to(q_nope.dtype)    # [R, H, rank]


def gather_latents(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: list[int],
                   dcp: DCPGroup) -> list[torch.Tensor]:
    """The whole cached latent rows [seq_lens[i], D] of each listed request, reassembled in
    position order from every rank's shard with one all-gather. block_table: [N, W] the
    requests' rows; seq_lens: their (global) lengths."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    width = dcp.local_len(lens, 0)                  # rank 0 stores the most of every request
    start = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(width, out=start[1:])
    D = kv_cache.shape[-1]
    mine = kv_cache.new_zeros(int(start[-1]), D)                         # [sum width, D]
    local = dcp.local_len(lens)
    for i, n in enumerate(local.tolist()):
        if n:
            mine[start[i]:start[i] + n] = ref.paged_gather(kv_cache, block_table[i], n)
    every = dcp.all_gather(mine).reshape(-1, D)                          # [size * sum width, D]
    out = []
    for i, L in enumerate(lens.tolist()):
        pos = np.arange(L, dtype=np.int64)
        rows = dcp.owner(pos) * start[-1] + start[i] + dcp.local_index(pos)
        out.append(every[torch.from_numpy(rows).to(kv_cache.device)])   # [L, D]
    return out
