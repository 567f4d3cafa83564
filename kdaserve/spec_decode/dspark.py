"""DSpark proposer: K drafts per request from one parallel pass of the DSpark drafter
(models/dspark.py) plus its Markov head sampled left to right.

Each request owns MLA KV blocks in the drafter's cache (one latent cache per draft layer, no
KDA state) and `num_context`, the positions whose context latents are in it. The runner hands
over the target's chosen-layer outputs of every position it computes (`add_hidden`: prefill
chunks, decodes, every verified window position); `propose` then, per request with committed
tokens t_0..t_{L-1} (the bonus token last):
  1. context: positions num_context..L-2 (verified by the target) -> context latents;
  2. block: K rows [t_{L-1}, mask, ...] at positions L-1..L+K-2, non-causal over the context
     and the block -> base logits [K, V];
  3. Markov: row i's logits = base_i + bias(prev), prev = the token drawn at row i - 1.
Aux rows of rejected window positions are dropped (the context reads only positions <= L-2);
the block writes latents at positions >= L-1, which the next context pass overwrites before a
query reads them. Positions the target never computed (a prefix-cache hit) enter with zero aux:
the drafts stay deterministic, only their quality drops.

Drafts are greedy (argmax) or, with draft_sample_method="probabilistic", sampled from
softmax(logits / T) with q returned for the rejection sampler (as the other drafters). Eager
on every device (no CUDA graphs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kdaserve.attention.caches import allocate_caches
from kdaserve.attention.metadata import ModelCaches
from kdaserve.models.dspark import DSparkModel
from kdaserve.spec_decode.draft_model import (DRAFT_SAMPLE_METHODS, DraftProposal, _Allocator,
                                              sample_drafts)


@dataclass
class _DSparkRequest:
    block_ids: list[int]
    num_context: int = 0
    """Positions whose context latents are in the drafter's KV cache."""
    aux: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(first position, [m, len(layers) * D] target layer outputs) not consumed yet."""


class DSparkProposer:
    def __init__(self, model: DSparkModel, num_speculative_tokens: int, max_num_seqs: int,
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
        self.aux_layers = model.cfg.aux_hidden_state_layer_ids
        self.aux_dim = len(self.aux_layers) * model.cfg.target_hidden_size
        self.max_blocks_per_req = -(-(max_model_len + num_speculative_tokens) // block_size)
        num_blocks = num_blocks or max_num_seqs * self.max_blocks_per_req
        self.caches: ModelCaches = allocate_caches(model.args, num_blocks, block_size, 1, dtype,
                                                   self.device)
        self._blocks = _Allocator(list(range(num_blocks)))
        self.num_blocks = num_blocks
        self.requests: dict[str, _DSparkRequest] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._blocks.free)

    # -----------------------------------------------------------------------------------------

    def add_hidden(self, req_id: str, start: int, aux: torch.Tensor) -> None:
        """The target computed positions start..start+m-1: aux [m, len(layers) * D] (its
        chosen layers' outputs). Rows held for positions >= start are superseded."""
        req = self._get(req_id)
        kept = [(s, h[:start - s]) for s, h in req.aux if s < start]
        kept.append((start, aux))
        req.aux = kept

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
        token last); the target's aux of positions up to len - 2 were handed over."""
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
            if len(toks) - 1 < req.num_context:
                raise ValueError(f"request {rid!r}: {len(toks)} committed tokens but the DSpark "
                                 f"drafter already holds {req.num_context} context positions")
            need = -(-(len(toks) + self.k - 1) // self.block_size)
            if need > len(req.block_ids):
                req.block_ids.extend(self._blocks.take(need - len(req.block_ids),
                                                       "DSpark KV blocks"))
            reqs.append(req)
        temps = torch.tensor(temperatures if temperatures is not None else [0.0] * n,
                             dtype=torch.float32, device=self.device)
        kv = list(self.caches.mla_kv)

        # 1. context latents of positions num_context..L-2
        aux = [self._take_aux(r, r.num_context, len(t) - 1) for r, t in zip(reqs, token_ids)]
        slots = [self._slot(r, p) for r, t in zip(reqs, token_ids)
                 for p in range(r.num_context, len(t) - 1)]
        if slots:
            self.model.store_context(torch.cat(aux), kv, self._tensor(slots))
        for r, t in zip(reqs, token_ids):
            r.num_context = len(t) - 1

        # 2. the query blocks: K rows per request at positions L-1..L+K-2, non-causal
        k, mask = self.k, self.model.cfg.mask_token_id
        ids = [t[-1] if j == 0 else mask for t in token_ids for j in range(k)]
        slots = [self._slot(r, len(t) - 1 + j) for r, t in zip(reqs, token_ids) for j in range(k)]
        width = max(len(r.block_ids) for r in reqs)
        table = torch.zeros(n * k, width, dtype=torch.int32)
        for i, r in enumerate(reqs):
            table[i * k:(i + 1) * k, :len(r.block_ids)] = torch.tensor(r.block_ids,
                                                                        dtype=torch.int32)
        seq_lens = self._tensor([len(t) - 1 + k for t in token_ids for _ in range(k)])
        hidden = self.model.forward_block(self._tensor(ids), kv, self._tensor(slots),
                                          table.to(self.device), seq_lens.int())   # [n*K, D]
        base = self.model.base_logits(hidden).view(n, k, -1)                      # [n, K, V]

        # 3. the Markov head, left to right
        prev = self._tensor([t[-1] for t in token_ids])
        drafts, probs = [], []
        for j in range(k):
            _, bias = self.model.markov_bias(prev)
            tok, q = sample_drafts(base[:, j] + bias, temps, self.sample_method)
            drafts.append(tok)
            probs.append(q)
            prev = tok
        out_ids = torch.stack(drafts, dim=1).tolist()                         # [n, K]
        caps = max_drafts if max_drafts is not None else [k] * n
        out_ids = [d[:max(0, min(c, k))] for d, c in zip(out_ids, caps)]
        if self.sample_method == "greedy":
            return DraftProposal(out_ids)
        q_all = torch.stack(probs, dim=1)                                     # [n, K, V]
        rows = [q_all[i, :len(d)] for i, d in enumerate(out_ids)]
        return DraftProposal(out_ids, torch.cat(rows) if rows else None)

    # -----------------------------------------------------------------------------------------

    def _get(self, req_id: str) -> _DSparkRequest:
        req = self.requests.get(req_id)
        if req is None:
            req = self.requests[req_id] = _DSparkRequest([])
        return req

    def _slot(self, req: _DSparkRequest, pos: int) -> int:
        return req.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _tensor(self, xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    def _take_aux(self, req: _DSparkRequest, start: int, end: int) -> torch.Tensor:
        """The aux rows [end - start, len(layers) * D] of positions start..end-1 (zeros where
        none was handed over); the request's held rows are consumed (those past end-1 are
        rejected window positions)."""
        dtype = self.model.context_proj.weight.dtype
        out = torch.zeros(end - start, self.aux_dim, dtype=dtype, device=self.device)
        for s, h in req.aux:
            lo, hi = max(s, start), min(s + h.shape[0], end)
            if lo < hi:
                out[lo - start:hi - start] = h[lo - s:hi - s]
        req.aux = []
        return out
