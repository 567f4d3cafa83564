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

`propose_device` (async scheduling) does the same without the host knowing how many drafts
the target accepted: each step it runs the MTP entries of every position the step verified
(a spec row's first 1 + accepted window positions, all positions of the other rows; the rest
write no KV and are never read), pairing the target's hidden of the step with the next token
(the next input, or the token the row emitted last), MLA in the absorbed form per token for
spec rows, positions fixed on the device; then the K - 1 one-token steps at device positions.
A prefix-cache hit enters its skipped positions with zero hidden when first seen.

Drafts are greedy (argmax) or, with draft_sample_method="probabilistic", sampled from
softmax(logits / T) with q returned for the rejection sampler (as the draft-model proposer).
Eager on every device (no CUDA graphs).
"""

from __future__ import annotations

import numpy as np
import torch

from kdaserve.attention.builder import build_metadata
from kdaserve.attention.forward_context import ForwardContext
from kdaserve.models.mtp import KimiMTPModel
from kdaserve.spec_decode.device_step import DeviceStep
from kdaserve.spec_decode.draft_model import DraftProposal, sample_drafts
from kdaserve.spec_decode.hidden_proposer import HiddenConditionedProposer


class MTPProposer(HiddenConditionedProposer):
    label = "MTP"
    device_proposals = True
    """propose_device works (async scheduling)."""

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
        tok, q = sample_drafts(self.model.compute_logits(prev), temps, self.sample_method,
                               self.race_draws)
        drafts.append(tok)
        probs.append(q)
        # 2. K - 1 one-token steps: draft j at position L - 2 + j
        for j in range(1, self.k):
            prev = self._forward([[t] for t in drafts[-1].tolist()], list(prev[:, None]),
                                 [r.num_done + j - 1 for r in reqs],
                                 [r.block_ids for r in reqs])
            tok, q = sample_drafts(self.model.compute_logits(prev), temps, self.sample_method,
                                   self.race_draws)
            drafts.append(tok)
            probs.append(q)
        return self._proposal(drafts, probs, max_drafts)

    @torch.inference_mode()
    def propose_device(self, step: DeviceStep) -> tuple[torch.Tensor | None,
                                                         torch.Tensor | None]:
        """The entries of the positions `step` verified, then K drafts per sampling row.
        Returns (drafts [S, K] int64, q [S, K, V] or None) on the device ((None, None): S = 0)."""
        dev, bs = self.device, self.block_size
        d, dtype = self.model.args.hidden_size, self.caches.mla_kv[0].dtype
        rows = [i for i, r in enumerate(step.req_ids) if r is not None]
        for i in rows:
            rid, c = step.req_ids[i], step.num_computed[i]
            if rid not in self.requests and c > 0:   # a prefix hit: zero hidden before c
                req = self._admit_device(rid, c + step.query_lens[i])
                toks = step.token_ids[i]
                self._forward([toks[1:c + 1]], [torch.zeros(c, d, dtype=dtype, device=dev)],
                              [0], [req.block_ids])
            self._admit_device(rid, c + step.query_lens[i])
        if rows:
            self._entries(step, rows)
        if not step.sample_rows:
            return None, None
        # drafts: the last verified entry's output, then K - 1 one-token steps
        s, reqs = len(step.sample_rows), [self.requests[step.req_ids[i]]
                                          for i in step.sample_rows]
        prev = self._last_out                                                 # [S, D]
        temps = torch.tensor(step.temperatures, dtype=torch.float32).to(dev, non_blocking=True)
        srows = self._tensor(step.sample_rows)
        base = step.start.index_select(0, srows) + step.verified.index_select(0, srows)
        table = self._device_table([step.req_ids[i] for i in step.sample_rows])
        bound = [step.num_computed[i] + step.query_lens[i] for i in step.sample_rows]
        drafts, probs = [], []
        tok, q = sample_drafts(self.model.compute_logits(prev), temps, self.sample_method,
                               self.race_draws)
        drafts.append(tok)
        probs.append(q)
        for j in range(1, self.k):
            pos = base + j - 1                                                # [S]
            md = build_metadata([1] * s, [b + j - 1 for b in bound],
                                [r.block_ids for r in reqs], [0] * s, bs, dev)
            md.seq_lens.copy_(pos + 1)
            md.slot_mapping.copy_(self._slots(table, pos))
            prev = self.model(drafts[-1], prev, pos == 0, ForwardContext(md, self.caches))
            tok, q = sample_drafts(self.model.compute_logits(prev), temps, self.sample_method,
                                   self.race_draws)
            drafts.append(tok)
            probs.append(q)
        q_all = None if self.sample_method == "greedy" else torch.stack(probs, dim=1)
        return torch.stack(drafts, dim=1), q_all

    def _entries(self, step: DeviceStep, rows: list[int]) -> None:
        """One MTP forward over the step's tokens of `rows` (the drafted batch rows, decodes
        first as in the batch): entry p = (hidden h_p, token t_{p+1}) at the true positions;
        keeps the output of each sampling row's last verified entry in _last_out [S, D]."""
        dev, bs = self.device, self.block_size
        qsl = np.cumsum([0] + step.query_lens)
        lens = [step.query_lens[i] for i in rows]
        tok = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in rows])    # [T'] host
        tok_d = self._tensor(tok.tolist())
        sub_qsl = np.cumsum([0] + lens)
        row_of = np.repeat(np.arange(len(rows)), lens)                         # [T'] sub row
        off = np.arange(len(tok)) - sub_qsl[row_of]
        rows_d = self._tensor(rows)
        start = step.start.index_select(0, rows_d)                             # [n']
        verified = step.verified.index_select(0, rows_d)
        host_start = [step.num_computed[i] for i in rows]
        md = build_metadata(lens, host_start,
                            [self.requests[step.req_ids[i]].block_ids for i in rows],
                            [0] * len(rows), bs, dev)
        row_d, off_d = self._tensor(row_of.tolist()), self._tensor(off.tolist())
        pos = start.index_select(0, row_d) + off_d                             # [T'] true
        keep = off_d < verified.index_select(0, row_d)
        table = self._device_table([step.req_ids[i] for i in rows])
        md.seq_lens.copy_(start + torch.tensor(lens).to(dev, non_blocking=True))
        md.slot_mapping.copy_(torch.where(keep, self._slots(table.index_select(0, row_d), pos),
                                          -1))
        spec = [j for j, i in enumerate(rows) if step.is_spec[i]]
        if spec:   # absorbed MLA per token: token at p sees positions <= p
            from kdaserve.attention.metadata import MLAAbsorbedRows

            t_spec = np.concatenate([np.arange(sub_qsl[j], sub_qsl[j + 1]) for j in spec])
            t_spec_d = self._tensor(t_spec.tolist())
            md.mla_absorbed = MLAAbsorbedRows(
                spec, None, t_spec_d, (pos.index_select(0, t_spec_d) + 1).int(),
                md.block_table.index_select(0, row_d.index_select(0, t_spec_d)))
        # t_{p+1}: the next input of the row, or at the last verified entry of a sampling row
        # the token it emitted last; a prefill chunk's last entry: the next prompt token
        ids = step.input_ids.index_select(0, tok_d)
        nxt = torch.cat([ids[1:], ids[:1]])
        ends = [sub_qsl[j + 1] - 1 for j, i in enumerate(rows) if i not in step.sample_rows]
        if ends:
            nxt[self._tensor(ends)] = self._tensor(
                [step.token_ids[i][step.num_computed[i] + step.query_lens[i]]
                 for i in rows if i not in step.sample_rows])
        samp = [rows.index(i) for i in step.sample_rows]
        last_tok = None
        if samp:
            samp_d = self._tensor(samp)
            last_tok = self._tensor(sub_qsl[samp].tolist()) + verified.index_select(0, samp_d) - 1
            nxt[last_tok] = step.last
        hidden = step.aux.index_select(0, tok_d)
        out = self.model(nxt, hidden, pos == 0, ForwardContext(md, self.caches))   # [T', D]
        self._last_out = out.index_select(0, last_tok) if last_tok is not None else None

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
