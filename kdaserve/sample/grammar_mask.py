"""Grammar masks on the logits: a structured-output step's token bitmask, moved to the device and
applied in place before sampling (tokens the grammar forbids get -inf).

The engine core fills one bitmask row per logits row of each structured request it schedules
(`SchedulerOutput.grammar_bitmask`, int32 words, bit t of a row = token t allowed). The runner
picks the rows of the requests that sample this step and where their logits rows are
(`GrammarMask.build`); on CUDA the rows go to the device through pinned memory without a host
wait, and xgrammar's kernel masks the logits (its CPU kernel on the CPU reference path). Steps
without a structured request never build one.

Logprobs come from the masked logits (as in vLLM, which masks before its sampler).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GrammarMask:
    bitmask: torch.Tensor
    """[>= max row + 1, ceil(V / 32)] int32 on the logits' device: row i masks logits row i
    (rows of unconstrained logits rows are left unset and never read)."""
    rows: torch.Tensor | None
    """[N] int32 on the device: the logits rows to mask (None: every row)."""

    @classmethod
    def build(cls, bitmask: torch.Tensor, src_rows: list[int], dst_rows: list[int],
              num_logit_rows: int, device: torch.device | str) -> GrammarMask:
        """bitmask: [M, W] int32 host rows; bitmask row src_rows[k] masks logits row
        dst_rows[k] (of num_logit_rows)."""
        rows = None
        if src_rows != dst_rows or len(dst_rows) != num_logit_rows:
            # xgrammar reads row i of the bitmask for logits row i: align them.
            aligned = torch.empty((max(dst_rows) + 1, bitmask.shape[1]), dtype=bitmask.dtype)
            aligned[torch.tensor(dst_rows, dtype=torch.long)] = \
                bitmask[torch.tensor(src_rows, dtype=torch.long)]
            bitmask = aligned
            if len(dst_rows) != num_logit_rows:
                rows = _to_device(torch.tensor(dst_rows, dtype=torch.int32), device)
        return cls(_to_device(bitmask, device), rows)


def apply_grammar_bitmask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """logits: [R, V] (contiguous rows), masked in place."""
    import xgrammar as xgr

    if logits.is_cuda:
        indices = mask.rows
    else:
        indices = None if mask.rows is None else mask.rows.tolist()
    xgr.apply_token_bitmask_inplace(logits, mask.bitmask, vocab_size=logits.shape[-1],
                                    indices=indices)


def _to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """To CUDA through pinned staging without blocking the host; elsewhere a plain copy."""
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
