"""MTP proposer: the target's own MTP layer (models/mtp.py) drafts K tokens per request from
the target's pre-final-norm hidden states.

The MTP entry at position p pairs the target's hidden h_p with the committed token t_{p+1};
its output predicts t_{p+2}. Each request owns MLA KV blocks in the drafter's cache (one MLA
layer, no KDA state) and `num_done`, the positions whose entries are in it. The runner hands
over the hidden state of every position the target computes (`add_hidden`: prefill chunks,
decodes, every verified window position); `propose` then, per request with committed tokens
t_0..t_{L-1} (the bonus token last):
  1. catch-up: one varlen forward over positions num_done..L-2 (pairs (h_p, t_{p+1}));
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

import torch

from kdaserve.attention.builder import build_metadata
from kdaserve.attention.forward_context import ForwardContext
from kdaserve.models.mtp import KimiMTPModel
from kdaserve.spec_decode.draft_model import DraftProposal, sample_drafts
from kdaserve.spec_decode.hidden_proposer import HiddenConditionedProposer


class MTPProposer(HiddenConditionedProposer):
    label = "MTP"

    model: KimiMTPModel

    @torch.inference_mode()
    def propose(self, req_ids: list[str], token_ids: list[list[int]],
                temperatures: list[float] | None = None,
                max_drafts: list[int] | None = None) -> DraftProposal:
        """As DraftModelProposer.propose: token_ids[i] = request i's committed tokens (the bonus
        token last); the target's hidden states of positions up to len - 2 were handed over."""
        n = len(req_ids)
        reqs = self._admit(req_ids, token_ids, min_new=1)
        if n == 0:
            return DraftProposal([])
        temps = torch.tensor(temperatures if temperatures is not None else [0.0] * n,
                             dtype=torch.float32, device=self.device)

        # 1. catch-up over positions num_done..L-2 (decodes first, as build_metadata expects)
        starts = [r.num_done for r in reqs]
        ids = [toks[s + 1:] for s, toks in zip(starts, token_ids)]
        d, dtype = self.model.args.hidden_size, self.caches.mla_kv[0].dtype
        hidden = [self._take_hidden(r, s, len(toks) - 1, d, dtype) for r, s, toks in
                  zip(reqs, starts, token_ids)]
        order = sorted(range(n), key=lambda i: not (len(ids[i]) == 1 and starts[i] > 0))
        out = self._forward([ids[i] for i in order], [hidden[i] for i in order],
                            [starts[i] for i in order], [reqs[i].block_ids for i in order])
        inv = torch.empty(n, dtype=torch.long)
        inv[torch.tensor(order)] = torch.arange(n)
        prev = out[inv.to(self.device)]                                       # [n, D]
        for r, toks in zip(reqs, token_ids):
            r.num_done = len(toks) - 1

        drafts, probs = [], []
        tok, q = sample_drafts(self.model.compute_logits(prev), temps, self.sample_method)
        drafts.append(tok)
        probs.append(q)
        # 2. K - 1 one-token steps: draft j at position L - 2 + j
        for j in range(1, self.k):
            prev = self._forward([[t] for t in drafts[-1].tolist()], list(prev[:, None]),
                                 [r.num_done + j - 1 for r in reqs],
                                 [r.block_ids for r in reqs])
            tok, q = sample_drafts(self.model.compute_logits(prev), temps, self.sample_method)
            drafts.append(tok)
            probs.append(q)
        return self._proposal(drafts, probs, max_drafts)

    # -----------------------------------------------------------------------------------------

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
