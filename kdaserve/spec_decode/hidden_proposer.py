"""What the drafters conditioned on the target's hidden states (MTP, DSpark) share: each request's
KV blocks in the drafter's own MLA cache, the hidden rows the runner handed over and not yet
consumed, admission (length checks, blocks for K more positions) and the proposal's packing.

A request's `num_done` counts the positions the drafter has consumed (their entries are in its
cache); `held` keeps (first position, [m, W] rows) chunks of hidden rows (W: the drafter's
hidden width). A chunk handed over for positions >= p supersedes the rows held for them (a
rollback: the rows of rejected window positions are replaced when the target recomputes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kdaserve.attention.caches import allocate_caches
from kdaserve.attention.metadata import ModelCaches
from kdaserve.spec_decode.draft_model import DRAFT_SAMPLE_METHODS, DraftProposal, _Allocator


@dataclass
class HiddenRequest:
    block_ids: list[int]
    num_done: int = 0
    """Positions whose drafter entries are in the drafter's KV cache."""
    held: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(first position, [m, W] hidden rows) chunks not consumed yet."""


class HiddenConditionedProposer:
    """model: the drafter (its `args` give its MLA cache's shapes); label: its name in errors."""

    label = "drafter"

    def __init__(self, model: torch.nn.Module, num_speculative_tokens: int, max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device | str,
                 dtype: torch.dtype, draft_sample_method: str = "greedy",
                 num_blocks: int | None = None, race_draws: bool = False) -> None:
        """race_draws: probabilistic drafts drawn and their q computed by the fused kernels of
        kernels/sample (race.py, softmax.py) on CUDA (LayerBackends.race_sampler)."""
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, "
                             f"got {draft_sample_method!r}")
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.sample_method = draft_sample_method
        self.race_draws = race_draws
        self.max_blocks_per_req = -(-(max_model_len + num_speculative_tokens) // block_size)
        num_blocks = num_blocks or max_num_seqs * self.max_blocks_per_req
        self.caches: ModelCaches = allocate_caches(model.args, num_blocks, block_size, 1, dtype,
                                                   self.device)
        self._blocks = _Allocator(list(range(num_blocks)))
        self.num_blocks = num_blocks
        self.requests: dict[str, HiddenRequest] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._blocks.free)

    def add_hidden(self, req_id: str, start: int, hidden: torch.Tensor) -> None:
        """The target computed positions start..start+m-1 of the request: hidden [m, W]. Rows
        already held for positions >= start are superseded (a rollback)."""
        req = self._get(req_id)
        req.held = [(s, h[:start - s]) for s, h in req.held if s < start] + [(start, hidden)]

    def free(self, req_id: str) -> None:
        """Drop a finished / aborted / preempted request (a preempted one restarts from its
        prompt: the runner hands its hidden states over again)."""
        req = self.requests.pop(req_id, None)
        if req is not None:
            self._blocks.give(req.block_ids)

    # -----------------------------------------------------------------------------------------

    def _get(self, req_id: str) -> HiddenRequest:
        req = self.requests.get(req_id)
        if req is None:
            req = self.requests[req_id] = HiddenRequest([])
        return req

    def _admit(self, req_ids: list[str], token_ids: list[list[int]],
               min_new: int) -> list[HiddenRequest]:
        """Each request's state, with blocks for its committed tokens and K - 1 more positions.
        min_new: how many positions past num_done the committed tokens must reach (beyond
        len - 1) for the proposal to be consistent."""
        if len(token_ids) != len(req_ids):
            raise ValueError(f"{len(req_ids)} req_ids but {len(token_ids)} token lists")
        reqs = []
        for rid, toks in zip(req_ids, token_ids):
            if len(toks) > self.max_model_len:
                raise ValueError(f"request {rid!r} has {len(toks)} tokens, over the drafter's "
                                 f"max_model_len {self.max_model_len}")
            req = self._get(rid)
            if len(toks) - 1 < req.num_done + min_new:
                raise ValueError(f"request {rid!r}: {len(toks)} committed tokens but the "
                                 f"{self.label} drafter already holds {req.num_done} positions")
            need = -(-(len(toks) + self.k - 1) // self.block_size)
            if need > len(req.block_ids):
                req.block_ids.extend(self._blocks.take(need - len(req.block_ids),
                                                       f"{self.label} KV blocks"))
            reqs.append(req)
        return reqs

    def _admit_device(self, req_id: str, num_tokens: int) -> HiddenRequest:
        """The request's state with blocks for positions < num_tokens + K (the block of a
        proposal from a window ending there)."""
        if num_tokens > self.max_model_len + self.k:
            raise ValueError(f"request {req_id!r} reaches position {num_tokens}, over the "
                             f"drafter's max_model_len {self.max_model_len}")
        req = self._get(req_id)
        need = -(-(num_tokens + self.k) // self.block_size)
        if need > len(req.block_ids):
            req.block_ids.extend(self._blocks.take(need - len(req.block_ids),
                                                   f"{self.label} KV blocks"))
        return req

    def _device_table(self, req_ids: list[str | None]) -> torch.Tensor:
        """[N, W] int64 block tables of the requests on the device (zeros for None)."""
        width = max([len(self.requests[r].block_ids) for r in req_ids if r is not None],
                    default=1)
        table = torch.zeros(len(req_ids), width, dtype=torch.long)
        for i, r in enumerate(req_ids):
            if r is not None:
                ids = self.requests[r].block_ids
                table[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        return table.to(self.device, non_blocking=True)

    def _slots(self, table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Cache slots of positions pos [R] through block-table rows [R, W] (device)."""
        col = (pos // self.block_size).clamp(max=table.shape[1] - 1)
        return table.gather(1, col[:, None]).squeeze(1) * self.block_size + pos % self.block_size

    def _slot(self, req: HiddenRequest, pos: int) -> int:
        return req.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _tensor(self, xs: list[int]) -> torch.Tensor:
        """int64 on the device, copied without waiting for the device."""
        return torch.tensor(xs, dtype=torch.long).to(self.device, non_blocking=True)

    def _take_hidden(self, req: HiddenRequest, start: int, end: int, width: int,
                     dtype: torch.dtype) -> torch.Tensor:
        """The hidden rows [end - start, width] of positions start..end-1 (zeros where none was
        handed over); the request's held rows are consumed (those past end-1 are rejected
        window positions)."""
        out = torch.zeros(end - start, width, dtype=dtype, device=self.device)
        for s, h in req.held:
            lo, hi = max(s, start), min(s + h.shape[0], end)
            if lo < hi:
                out[lo - start:hi - start] = h[lo - s:hi - s]
        req.held = []
        return out

    def _proposal(self, drafts: list[torch.Tensor], probs: list[torch.Tensor | None],
                  max_drafts: list[int] | None) -> DraftProposal:
        """drafts[j] [n]: the j-th draft of every request; probs[j] [n, V] (probabilistic)."""
        out_ids = torch.stack(drafts, dim=1).tolist()                         # [n, K]
        caps = max_drafts if max_drafts is not None else [self.k] * len(out_ids)
        out_ids = [d[:max(0, min(c, self.k))] for d, c in zip(out_ids, caps)]
        if self.sample_method == "greedy":
            return DraftProposal(out_ids)
        q_all = torch.stack(probs, dim=1)                                     # [n, K, V]
        rows = [q_all[i, :len(d)] for i, d in enumerate(out_ids)]
        return DraftProposal(out_ids, torch.cat(rows) if rows else None)
