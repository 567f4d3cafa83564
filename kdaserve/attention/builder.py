"""Build AttentionMetadata from plain per-request lists (tests, CPU runner, eager GPU steps)."""

from __future__ import annotations

import torch

from kdaserve.attention.metadata import AttentionMetadata


def build_metadata(query_lens: list[int], num_computed: list[int], block_ids: list[list[int]],
                   state_slots: list[int], block_size: int, device: torch.device | str,
                   num_decodes: int | None = None) -> AttentionMetadata:
    """Requests must already be ordered decodes first (one new token on a non-empty context).

    block_ids[i] covers at least num_computed[i] + query_lens[i] tokens.
    """
    n = len(query_lens)
    if num_decodes is None:
        num_decodes = 0
        while (num_decodes < n and query_lens[num_decodes] == 1
               and num_computed[num_decodes] > 0):
            num_decodes += 1
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    seq_lens = [c + q for c, q in zip(num_computed, query_lens)]
    slots = []
    for q, c, blocks in zip(query_lens, num_computed, block_ids):
        for pos in range(c, c + q):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    max_blocks = max((len(b) for b in block_ids), default=1) or 1
    table = torch.zeros(n, max_blocks, dtype=torch.int32)
    for i, b in enumerate(block_ids):
        table[i, :len(b)] = torch.tensor(b, dtype=torch.int32)
    qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
    seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_reqs=n,
        num_decodes=num_decodes,
        num_actual_tokens=qsl[-1],
        query_start_loc=qsl_cpu.to(device),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_cpu.to(device),
        seq_lens_cpu=seq_cpu,
        num_computed_tokens_cpu=torch.tensor(num_computed, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_table=table.to(device),
        state_indices=torch.tensor(state_slots, dtype=torch.int32, device=device),
        has_initial_state=torch.tensor([c > 0 for c in num_computed], dtype=torch.bool,
                                       device=device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
