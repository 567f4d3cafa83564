"""MTP proposer: the target's own MTP layer (models/mtp.py) drafts K tokens per request from
the target's pre-final-norm hidden states.

The MTP entry at position p pairs the target's hidden h_p with the committed token t_{p+1};
its output predicts t_{p+2}. Each request owns MLA KV blocks in the drafter's cache (one MLA
layer, no KDA state) and `num_computed`, the positions whose entries are in it. The runner hands
over the hidden state of every position the target computes (`add_hidden`: prefill chunks,
decodes, every verified window position); `propose` then, per request with committed tokens
t_0..t_{L-1} (the bonus token last):
  1. catch-up: one varlen forward over positions num_computed..L-2 (pairs (h_p, t_{p+1}));
     the last output gives draft 1 and is kept as the next step's hidden;
  2. K - 1 one-token steps: draft j enters at position L-2+j with the previous step's output
     as its hidden.
Hidden rows of rejected window positions are dropped (the catch-up only reads positions <=
L-2, which the target accepted); draft steps write KV at positions >= L-1, which the next
catch-up overwrites before any query reads them. Positions the target never computed (a
prefix-cache hit) enter with a zero hidden: the drafts stay deterministic, only their quality
drops, and verification decides what is emitted.

Drafts are greedy (argmax) or, with draft_sample_method="probabilistic", sampled from
softmax(logits / T) with q returned for the rejection sampler (as the draft-model proposer).
Eager on every device (no CUDA graphs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kdaserve.attention.builder import build_metadata
from kdaserve.attention.caches import allocate_caches
from kdaserve.attention.forward_context import ForwardContext
from kdaserve.attention.metadata import ModelCaches
from kdaserve.models.mtp import KimiMTPModel
from kdaserve.spec_decode.draft_model import (DRAFT_SAMPLE_METHODS, DraftProposal, _Allocator,
                                              sample_drafts)


@dataclass
class _MTPRequest:
    block_ids: list[int]
    num_computed: int = 0
    """Positions p whose MTP entry (h_p, t_{p+1}) is in the drafter's KV cache."""
    hidden: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(first position, [m, D] pre-norm target hidden) chunks not consumed yet."""


class MTPProposer:
    def __init__(self, model: KimiMTPModel, num_speculative_tokens: int, max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device | str,
                 dtype: torch.dtype, draft_sample_method: str = "greedy",
                 num_blocks: int | None = None) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, "
                             f"got {draft_sample_method!r}")
        self.model = model
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.sample_method = draft_sample_method
        self.max_blocks_per_req = -(-(max_model_len + num_speculative_tokens) // block_size)
        num_blocks = num_blocks or max_num_seqs * self.max_blocks_per_req
        self.caches: ModelCaches = allocate_caches(model.args, num_blocks, block_size, 1, dtype,
                                                   self.device)
        self._blocks = _Allocator(list(range(num_blocks)))
        self.num_blocks = num_blocks
        self.requests: dict[str, _MTPRequest] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._blocks.free)

    # -----------------------------------------------------------------------------------------

    def add_hidden(self, req_id: str, start: int, hidden: torch.Tensor) -> None:
        """The target computed positions start..start+m-1 of the request: hidden [m, D] (pre-
        final-norm). Rows already held for positions >= start are superseded (a rollback)."""
        req = self._get(req_id)
        kept = []
        for s, h in req.hidden:
            if s < start:
                kept.append((s, h[:start - s]))
        kept.append((start, hidden))
        req.hidden = kept

    def free(self, req_id: str) -> None:
        """Drop a finished / aborted / preempted request (a preempted one restarts from its
        prompt: the runner hands its hidden states over again)."""
        req = self.requests.pop(req_id, None)
        if req is not None:
            self._blocks.give(req.block_ids)

    @torch.inference_mode()
    def propose(self, req_ids: list[str], token_ids: list[list[int]],
                temperatures: list[float] | None = None,
                max_drafts: list[int] | None = None) -> DraftProposal:
        """As DraftModelProposer.propose: token_ids[i] = request i's committed tokens (the bonus
        token last); the target's hidden states of positions up to len - 2 were handed over."""
        n = len(req_ids)
        if len(token_ids) != n:
            raise ValueError(f"{n} req_ids but {len(token_ids)} token lists")
        if n == 0:
            return DraftProposal([])
        reqs = []
        for rid, toks in zip(req_ids, token_ids):
            if len(toks) > self.max_model_len:
                raise ValueError(f"request {rid!r} has {len(toks)} tokens, over the drafter's "
                                 f"max_model_len {self.max_model_len}")
            req = self._get(rid)
            if len(toks) - 1 <= req.num_computed:
                raise ValueError(f"request {rid!r}: {len(toks)} committed tokens but the MTP "
                                 f"drafter has already computed {req.num_computed} positions")
            need = -(-(len(toks) + self.k - 1) // self.block_size)
            if need > len(req.block_ids):
                req.block_ids.extend(self._blocks.take(need - len(req.block_ids),
                                                       "MTP KV blocks"))
            reqs.append(req)
        temps = torch.tensor(temperatures if temperatures is not None else [0.0] * n,
                             dtype=torch.float32, device=self.device)

        # 1. catch-up over positions num_computed..L-2 (decodes first, as build_metadata expects)
        starts = [r.num_computed for r in reqs]
        ids = [toks[s + 1:] for s, toks in zip(starts, token_ids)]
        hidden = [self._take_hidden(r, s, len(toks) - 1) for r, s, toks in
                  zip(reqs, starts, token_ids)]
        order = sorted(range(n), key=lambda i: not (len(ids[i]) == 1 and starts[i] > 0))
        out = self._forward([ids[i] for i in order], [hidden[i] for i in order],
                            [starts[i] for i in order], [reqs[i].block_ids for i in order])
        inv = torch.empty(n, dtype=torch.long)
        inv[torch.tensor(order)] = torch.arange(n)
        prev = out[inv.to(self.device)]                                       # [n, D]
        for r, toks in zip(reqs, token_ids):
            r.num_computed = len(toks) - 1

        drafts, probs = [], []
        tok, q = sample_drafts(self.model.compute_logits(prev), temps, self.sample_method)
        drafts.append(tok)
        probs.append(q)
        # 2. K - 1 one-token steps: draft j at position L - 2 + j
        for j in range(1, self.k):
            prev = self._forward([[t] for t in drafts[-1].tolist()], list(prev[:, None]),
                                 [r.num_computed + j - 1 for r in reqs],
                                 [r.block_ids for r in reqs])
            tok, q = sample_drafts(self.model.compute_logits(prev), temps, self.sample_method)
            drafts.append(tok)
            probs.append(q)
        out_ids = torch.stack(drafts, dim=1).tolist()                         # [n, K]
        caps = max_drafts if max_drafts is not None else [self.k] * n
        out_ids = [d[:max(0, min(c, self.k))] for d, c in zip(out_ids, caps)]
        if self.sample_method == "greedy":
            return DraftProposal(out_ids)
        q_all = torch.stack(probs, dim=1)                                     # [n, K, V]
        rows = [q_all[i, :len(d)] for i, d in enumerate(out_ids)]
        return DraftProposal(out_ids, torch.cat(rows) if rows else None)

    # -----------------------------------------------------------------------------------------

    def _get(self, req_id: str) -> _MTPRequest:
        req = self.requests.get(req_id)
        if req is None:
            req = self.requests[req_id] = _MTPRequest([])
        return req

    def _take_hidden(self, req: _MTPRequest, start: int, end: int) -> torch.Tensor:
        """The target hidden [end - start, D] of positions start..end-1 (zeros where none was
        handed over); the request's held rows are consumed (those past end-1 are rejected
        window positions)."""
        d = self.model.args.hidden_size
        out = torch.zeros(end - start, d, dtype=self.caches.mla_kv[0].dtype, device=self.device)
        for s, h in req.hidden:
            lo, hi = max(s, start), min(s + h.shape[0], end)
            if lo < hi:
                out[lo - start:hi - start] = h[lo - s:hi - s]
        req.hidden = []
        return out

    def _forward(self, ids: list[list[int]], hidden: list[torch.Tensor], starts: list[int],
                 block_ids: list[list[int]]) -> torch.Tensor:
        """One MTP forward: row i feeds tokens ids[i] with hidden [len, D] at positions
        starts[i]...; returns the pre-norm output [n, D] at each row's last position."""
        lens = [len(x) for x in ids]
        md = build_metadata(lens, starts, block_ids, [0] * len(ids), self.block_size,
                            self.device)
        flat = torch.tensor([t for x in ids for t in x], dtype=torch.long, device=self.device)
        pos = torch.tensor([s + j for s, m in zip(starts, lens) for j in range(m)],
                           device=self.device)
        h = torch.cat([x.reshape(-1, x.shape[-1]) for x in hidden])           # [T, D]
        out = self.model(flat, h, pos == 0, ForwardContext(md, self.caches))  # [T, D]
        last = (md.query_start_loc[1:] - 1).long()
        return out[last]
