"""Build AttentionMetadata from plain per-request lists (tests, CPU runner, eager GPU steps) or
over CUDA-graph input buffers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kdaserve.attention import dcp as dcp_layout
from kdaserve.attention.dcp import DCPGroup, DCPMetadata
from kdaserve.attention.metadata import (AttentionMetadata, KDACheckpointRequest, MLAAbsorbedRows,
                                        SpecStep)


def _h2d(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on the device, staged without waiting for the device."""
    return t.to(device, non_blocking=True)


def slot_mapping(table: np.ndarray, req: np.ndarray, pos: np.ndarray,
                 block_size: int, dcp: DCPGroup | None = None) -> np.ndarray:
    """Flat latent-KV slot of each token: token i of request req[i] at position pos[i], block
    tables [num_reqs, W] -> int64 [num_tokens]. With dcp, the slot on this rank (-1 for the
    positions other ranks of the group store; attention/dcp.py)."""
    if dcp is not None and dcp.size > 1:
        return dcp_layout.slot_mapping(table, req, pos, block_size, dcp)
    return table[req, pos // block_size].astype(np.int64) * block_size + pos % block_size


def build_metadata(query_lens: list[int], num_computed: list[int],
                   block_ids: Sequence[Sequence[int] | np.ndarray], state_slots: list[int],
                   block_size: int, device: torch.device | str,
                   num_decodes: int | None = None,
                   dcp: DCPGroup | None = None) -> AttentionMetadata:
    """Requests must already be ordered decodes first (one new token on a non-empty context).
    Host-to-device copies are non_blocking: staged from pageable memory, they do not wait for
    the device to finish the step before (async scheduling launches this one meanwhile).

    block_ids[i] (a list or an int array) covers at least num_computed[i] + query_lens[i]
    tokens (with dcp: logical blocks of dcp.size * block_size tokens, block_size on this rank).
    Vectorised with numpy: the slot mapping of an 8000-token prefill costs no Python loop over
    tokens. dcp (size > 1): this rank's slots and local context lengths (md.dcp).
    """
    n = len(query_lens)
    if num_decodes is None:
        num_decodes = 0
        while (num_decodes < n and query_lens[num_decodes] == 1
               and num_computed[num_decodes] > 0):
            num_decodes += 1
    q = np.asarray(query_lens, dtype=np.int64)
    c = np.asarray(num_computed, dtype=np.int64)
    qsl = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(q, out=qsl[1:])
    seq_lens = (c + q).astype(np.int32)
    max_blocks = max((len(b) for b in block_ids), default=1) or 1
    table = np.zeros((n, max_blocks), dtype=np.int32)
    for i, b in enumerate(block_ids):
        table[i, :len(b)] = b
    total = int(qsl[-1])
    req = np.repeat(np.arange(n), q)                                  # [T] request of each token
    pos = np.arange(total, dtype=np.int64) - qsl[:-1].astype(np.int64)[req] + c[req]
    dcp = dcp if dcp is not None and dcp.size > 1 else None
    slots = slot_mapping(table, req, pos, block_size, dcp)
    qsl_cpu = torch.from_numpy(qsl)
    seq_cpu = torch.from_numpy(seq_lens)
    dcp_md = None
    if dcp is not None:
        local = torch.from_numpy(dcp.local_len(seq_lens.astype(np.int64)).astype(np.int32))
        dcp_md = DCPMetadata(dcp, local.to(device))
    return AttentionMetadata(
        num_reqs=n,
        num_decodes=num_decodes,
        num_actual_tokens=total,
        query_start_loc=qsl_cpu.to(device, non_blocking=True),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_cpu.to(device, non_blocking=True),
        seq_lens_cpu=seq_cpu,
        num_computed_tokens_cpu=torch.from_numpy(c.astype(np.int32)),
        slot_mapping=torch.from_numpy(slots).to(device, non_blocking=True),
        block_table=torch.from_numpy(table).to(device, non_blocking=True),
        state_indices=torch.tensor(state_slots, dtype=torch.int32).to(device, non_blocking=True),
        has_initial_state=torch.from_numpy(c > 0).to(device, non_blocking=True),
        max_query_len=int(q.max()) if n else 0,
        max_seq_len=int(seq_lens.max()) if n else 0,
        dcp=dcp_md,
    )


def build_spec_step(md: AttentionMetadata, is_spec: list[bool], idx_spec: torch.Tensor,
                    layout: str, per_position: bool) -> SpecStep:
    """Split a step's metadata into its spec rows (is_spec[i]: request i verifies drafts) and
    the rest. contiguous: the spec rows must be the last ones; the non-spec metadata is then
    made of slices. gather: any order; the non-spec metadata is gathered. md.kda_checkpoints
    must name non-spec rows only (they are re-indexed for md_non)."""
    if md.dcp is not None:
        raise ValueError("speculative verification rows are not supported with decode context "
                         "parallelism")
    spec_rows = [i for i, s in enumerate(is_spec) if s]
    non_rows = [i for i, s in enumerate(is_spec) if not s]
    if not spec_rows:
        raise ValueError("build_spec_step needs at least one spec row")
    if md.kda_checkpoints is not None and set(md.kda_checkpoints.req_index) & set(spec_rows):
        raise ValueError("KDA checkpoint exports inside spec rows go through the commit, not "
                         "the forward")
    qsl = md.query_start_loc_cpu.tolist()
    lens = [qsl[i + 1] - qsl[i] for i in spec_rows]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    device = md.query_start_loc.device
    cu_spec = torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True)
    md.mla_absorbed = _mla_absorbed_rows(md, spec_rows, qsl, layout == "contiguous")
    if layout == "contiguous":
        n_non = len(non_rows)
        if spec_rows != list(range(n_non, md.num_reqs)):
            raise ValueError(f"contiguous spec layout needs the spec rows last, got rows "
                             f"{spec_rows} of {md.num_reqs}")
        return SpecStep(layout, per_position, qsl[n_non], cu_spec, idx_spec,
                        _slice_metadata(md, n_non) if n_non else None)
    if layout != "gather":
        raise ValueError(f"batch_layout must be contiguous or gather, got {layout!r}")
    tok_spec = [t for i in spec_rows for t in range(qsl[i], qsl[i + 1])]
    tok_non = [t for i in non_rows for t in range(qsl[i], qsl[i + 1])]
    return SpecStep(layout, per_position, len(tok_spec), cu_spec, idx_spec,
                    _gather_metadata(md, non_rows, tok_non) if non_rows else None,
                    tok_spec=_h2d(torch.tensor(tok_spec, dtype=torch.long), device),
                    tok_non=_h2d(torch.tensor(tok_non, dtype=torch.long), device))


def _mla_absorbed_rows(md: AttentionMetadata, rows: list[int], qsl: list[int],
                       contiguous: bool) -> MLAAbsorbedRows:
    """One absorbed-MLA row per token of the spec rows (see MLAAbsorbedRows)."""
    computed = md.num_computed_tokens_cpu.tolist()
    lens = [qsl[i + 1] - qsl[i] for i in rows]
    seq = np.concatenate([np.arange(computed[i] + 1, computed[i] + n + 1)
                          for i, n in zip(rows, lens)]).astype(np.int32)
    req_of_token = np.repeat(np.asarray(rows, dtype=np.int64), lens)
    device = md.block_table.device
    tokens = None
    if not contiguous:
        tokens = torch.from_numpy(np.concatenate([np.arange(qsl[i], qsl[i + 1])
                                                  for i in rows])).to(device, non_blocking=True)
    return MLAAbsorbedRows(
        reqs=list(rows), token_start=qsl[rows[0]] if contiguous else None, tokens=tokens,
        seq_lens=torch.from_numpy(seq).to(device, non_blocking=True),
        block_table=md.block_table[torch.from_numpy(req_of_token).to(device, non_blocking=True)],
        rows_per_seq=lens[0] if len(set(lens)) == 1 else 1)


def _slice_metadata(md: AttentionMetadata, n: int) -> AttentionMetadata:
    """The first n requests of md, as views."""
    qsl = md.query_start_loc_cpu[:n + 1]
    t = int(qsl[-1])
    return AttentionMetadata(
        num_reqs=n, num_decodes=min(md.num_decodes, n), num_actual_tokens=t,
        query_start_loc=md.query_start_loc[:n + 1], query_start_loc_cpu=qsl,
        seq_lens=md.seq_lens[:n], seq_lens_cpu=md.seq_lens_cpu[:n],
        num_computed_tokens_cpu=md.num_computed_tokens_cpu[:n],
        slot_mapping=md.slot_mapping[:t], block_table=md.block_table[:n],
        state_indices=md.state_indices[:n], has_initial_state=md.has_initial_state[:n],
        max_query_len=int((qsl[1:] - qsl[:-1]).max()), max_seq_len=int(md.seq_lens_cpu[:n].max()),
        kda_checkpoints=md.kda_checkpoints)


def _gather_metadata(md: AttentionMetadata, rows: list[int], tok: list[int]) -> AttentionMetadata:
    """Requests `rows` of md (in order; the decodes among them must lead) as a new batch."""
    device = md.query_start_loc.device
    r_cpu = torch.tensor(rows, dtype=torch.long)
    r_dev = r_cpu.to(device, non_blocking=True)
    q_cpu = md.query_start_loc_cpu[r_cpu + 1] - md.query_start_loc_cpu[r_cpu]
    qsl_cpu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qsl_cpu[1:] = torch.cumsum(q_cpu, 0)
    seq_cpu = md.seq_lens_cpu[r_cpu]
    ckpt = md.kda_checkpoints
    if ckpt is not None:
        where = {r: j for j, r in enumerate(rows)}
        ckpt = KDACheckpointRequest([where[i] for i in ckpt.req_index], list(ckpt.offsets),
                                    list(ckpt.dst_slots))
    return AttentionMetadata(
        num_reqs=len(rows), num_decodes=sum(1 for r in rows if r < md.num_decodes),
        num_actual_tokens=len(tok), query_start_loc=_h2d(qsl_cpu, device),
        query_start_loc_cpu=qsl_cpu, seq_lens=_h2d(seq_cpu, device), seq_lens_cpu=seq_cpu,
        num_computed_tokens_cpu=md.num_computed_tokens_cpu[r_cpu],
        slot_mapping=md.slot_mapping[_h2d(torch.tensor(tok, dtype=torch.long), device)],
        block_table=md.block_table[r_dev], state_indices=md.state_indices[r_dev],
        has_initial_state=md.has_initial_state[r_dev], max_query_len=int(q_cpu.max()),
        max_seq_len=int(seq_cpu.max()), kda_checkpoints=ckpt)



class StepBuffers:
    """Device inputs of a fixed-shape step (a CUDA graph's inputs): up to max_bs requests of k1
    token rows each. Padding requests use pad_slot and write no KV (slot_mapping -1);
    max_seq_len bounds the MLA split count, which keeps one grid across replays."""

    def __init__(self, max_bs: int, k1: int, max_blocks: int, pad_slot: int, max_seq_len: int,
                 device: torch.device | str) -> None:
        self.max_bs, self.k1, self.max_seq_len, self.pad_slot = max_bs, k1, max_seq_len, pad_slot
        tok = max_bs * k1
        self.input_ids = torch.zeros(tok, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(0, (max_bs + 1) * k1, k1, dtype=torch.int32,
                                            device=device)
        self.seq_lens = torch.full((max_bs,), k1, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((tok,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        self.state_indices = torch.full((max_bs,), pad_slot, dtype=torch.int32, device=device)
        self.has_initial_state = torch.ones(max_bs, dtype=torch.bool, device=device)

    def decode_metadata(self, bs: int) -> AttentionMetadata:
        """Metadata of a decode step of bs one-token rows over the buffers (k1 = 1)."""
        return AttentionMetadata(
            num_reqs=bs, num_decodes=bs, num_actual_tokens=bs,
            query_start_loc=self.query_start_loc[:bs + 1],
            query_start_loc_cpu=torch.arange(bs + 1, dtype=torch.int32),
            seq_lens=self.seq_lens[:bs], seq_lens_cpu=torch.ones(bs, dtype=torch.int32),
            num_computed_tokens_cpu=torch.zeros(bs, dtype=torch.int32),
            slot_mapping=self.slot_mapping[:bs], block_table=self.block_table[:bs],
            state_indices=self.state_indices[:bs], has_initial_state=self.has_initial_state[:bs],
            max_query_len=1, max_seq_len=self.max_seq_len)
