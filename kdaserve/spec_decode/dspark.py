"""DSpark proposer: K drafts per request from one parallel pass of the DSpark drafter
(models/dspark.py) plus its Markov head sampled left to right.

Each request owns MLA KV blocks in the drafter's cache (one latent cache per draft layer, no
KDA state) and `num_done`, the positions whose context latents are in it. The runner hands
over the target's chosen-layer outputs of every position it computes (`add_hidden`: prefill
chunks, decodes, every verified window position); `propose` then, per request with committed
tokens t_0..t_{L-1} (the bonus token last):
  1. context: positions num_done..L-2 (verified by the target) -> context latents;
  2. block: K rows [t_{L-1}, mask, ...] at positions L-1..L+K-2, non-causal over the context
     and the block -> base logits [K, V];
  3. Markov: row i's logits = base_i + bias(prev), prev = the token drawn at row i - 1.
Aux rows of rejected window positions are dropped (the context reads only positions <= L-2);
the block writes latents at positions >= L-1, which the next context pass overwrites before a
query reads them. Positions the target never computed (a prefix-cache hit) enter with zero aux:
the drafts stay deterministic, only their quality drops.

`propose_device` (async scheduling) does the same without the host knowing how many drafts
the target accepted: each step it stores the context latents of the positions the step
verified (a spec row's first 1 + accepted window positions, every position of the other
rows; the others get slot -1 and are not written) straight from the step's aux rows, then
runs the block from each sampling row's last token at a position computed on the device.
Prefix-cache hits store a zero context for the positions they skipped when first seen, as
`_take_hidden` does. Fixed shapes throughout (T context rows, S * K block rows).

Drafts are greedy (argmax) or, with draft_sample_method="probabilistic", sampled from
softmax(logits / T) with q returned for the rejection sampler (as the other drafters). On CUDA,
`propose_device`'s block pass and Markov head replay a CUDA graph per capture size of sampling
rows (spec_decode/dspark_graphs.py, captured by `capture_graphs`); after a verification graph
of a small batch the whole proposal, the context store included, replays one window graph
(spec_decode/dspark_window.py). Other steps' context store and the host path `propose` run
eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kdaserve.models.dspark import DSparkModel
from kdaserve.spec_decode.device_step import DeviceStep
from kdaserve.spec_decode.draft_model import DraftProposal
from kdaserve.spec_decode.dspark_graphs import DSparkBlockGraphs, block_drafts
from kdaserve.spec_decode.dspark_window import DSparkWindowGraphs
from kdaserve.spec_decode.hidden_proposer import HiddenConditionedProposer

if TYPE_CHECKING:
    from kdaserve.spec_decode.verify_graphs import SpecVerifyGraphs
    from kdaserve.worker.cuda_graphs import CudaGraphManager


class DSparkProposer(HiddenConditionedProposer):
    label = "DSpark"
    device_proposals = True
    """propose_device works (async scheduling)."""
    captures_windows = True
    """capture_graphs takes the target's verification graphs (the window graphs read them)."""

    model: DSparkModel

    def __init__(self, model: DSparkModel, *args, **kwargs) -> None:
        super().__init__(model, *args, **kwargs)
        self.aux_layers = model.cfg.aux_hidden_state_layer_ids
        self.aux_dim = len(self.aux_layers) * model.cfg.target_hidden_size
        self.graphs: DSparkBlockGraphs | None = None
        """The block pass + Markov head graphs, once capture_graphs() ran (CUDA)."""
        self.windows: DSparkWindowGraphs | None = None
        """The whole proposal after a verification graph (small sizes), once captured."""

    def capture_graphs(self, graphs: "CudaGraphManager",
                       verify: "SpecVerifyGraphs | None" = None) -> None:
        """Capture propose_device's block pass and Markov head at every capture size of
        sampling rows into `graphs` (after the target's caches are allocated); with the
        target's verification graphs (captured first), also the window graphs."""
        self.graphs = DSparkBlockGraphs(self, self.max_num_seqs)
        self.graphs.capture(graphs)
        if verify is not None and verify.hidden_outputs:
            self.windows = DSparkWindowGraphs(self, verify)
            self.windows.capture(graphs)

    def run_block_uncaptured(self) -> None:
        """capture_graphs' block passes without their Markov heads, eagerly (worker.py's
        compiles ahead of the captures)."""
        DSparkBlockGraphs(self, self.max_num_seqs).run_block_uncaptured()

    @torch.inference_mode()
    def propose(self, req_ids: list[str], token_ids: list[list[int]],
                temperatures: list[float] | None = None,
                max_drafts: list[int] | None = None) -> DraftProposal:
        """As DraftModelProposer.propose: token_ids[i] = request i's committed tokens (the bonus
        token last); the target's aux of positions up to len - 2 were handed over."""
        n = len(req_ids)
        reqs = self._admit(req_ids, token_ids, min_new=0)
        if n == 0:
            return DraftProposal([])
        temps = torch.tensor(temperatures if temperatures is not None else [0.0] * n,
                             dtype=torch.float32, device=self.device)
        kv = list(self.caches.mla_kv)

        # 1. context latents of positions num_done..L-2
        dtype = self.model.context_proj.weight.dtype
        aux = [self._take_hidden(r, r.num_done, len(t) - 1, self.aux_dim, dtype)
               for r, t in zip(reqs, token_ids)]
        slots = [self._slot(r, p) for r, t in zip(reqs, token_ids)
                 for p in range(r.num_done, len(t) - 1)]
        if slots:
            self.model.store_context(torch.cat(aux), kv, self._tensor(slots))
        for r, t in zip(reqs, token_ids):
            r.num_done = len(t) - 1

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

        # 3. the Markov head, left to right, after the block pass
        drafts, q = block_drafts(self.model, kv, self._tensor(ids), self._tensor(slots),
                                 table.to(self.device), seq_lens.int(),
                                 self._tensor([t[-1] for t in token_ids]), temps,
                                 self.sample_method, k, self.race_draws)      # [n, K]
        return self._proposal(list(drafts.unbind(1)),
                              [None] * k if q is None else list(q.unbind(1)), max_drafts)

    @torch.inference_mode()
    def propose_device(self, step: DeviceStep) -> tuple[torch.Tensor | None,
                                                         torch.Tensor | None]:
        """Store the context of the positions `step` verified, then draft K tokens per sampling
        row from its last token. Returns (drafts [S, K] int64, q [S, K, V] or None), both on
        the device (None, None: S = 0)."""
        req_ids, num_computed, query_lens = step.req_ids, step.num_computed, step.query_lens
        start, verified, aux, sample_rows = step.start, step.verified, step.aux, step.sample_rows
        k, dev = self.k, self.device
        if self.windows is not None and self.windows.covers(step, self.requests):
            for rid, c, q in zip(req_ids, num_computed, query_lens):
                self._admit_device(rid, c + q)
            return self.windows.run(step.verify_size,
                                    [self.requests[r].block_ids for r in req_ids], step)
        kv = list(self.caches.mla_kv)
        for rid, c, q in zip(req_ids, num_computed, query_lens):
            if rid is None:
                continue
            if rid not in self.requests and c > 0:   # a prefix hit: zero context before c
                req = self._admit_device(rid, c + q)
                self.model.store_context(torch.zeros(c, self.aux_dim, device=dev), kv,
                                         self._tensor([self._slot(req, p) for p in range(c)]))
            self._admit_device(rid, c + q)
        # 1. context latents of the verified positions (the others: slot -1, not written)
        n = len(req_ids)
        table = self._device_table(req_ids)                                    # [N, W]
        lens = np.asarray(query_lens, dtype=np.int64)
        tok_row_np = np.repeat(np.arange(n), lens)
        tok_off_np = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
        kept = np.asarray([r is not None for r in req_ids])[tok_row_np]
        tok_row, tok_off, keep = (self._tensor(tok_row_np.tolist()),
                                  self._tensor(tok_off_np.tolist()),
                                  torch.from_numpy(kept).to(dev, non_blocking=True))
        if aux.shape[0]:
            pos = start.index_select(0, tok_row) + tok_off                      # [T]
            keep = keep & (tok_off < verified.index_select(0, tok_row))
            slots = self._slots(table.index_select(0, tok_row), pos)
            self.model.store_context(aux, kv, torch.where(keep, slots, -1))
        if not sample_rows:
            return None, None

        # 2. the query blocks: K rows per sampling row from its last token's position
        s = len(sample_rows)
        rows = self._tensor(sample_rows)
        pos0 = start.index_select(0, rows) + verified.index_select(0, rows)     # [S]
        pos = (pos0[:, None] + torch.arange(k, device=dev)).reshape(-1)         # [S * K]
        tab = table.index_select(0, rows).repeat_interleave(k, dim=0)           # [S * K, W]
        ids = torch.full((s, k), self.model.cfg.mask_token_id, dtype=torch.long, device=dev)
        last = step.last
        ids[:, 0] = last
        seq_lens = (pos0 + k).repeat_interleave(k).int()
        temps = torch.tensor(step.temperatures, dtype=torch.float32).to(dev, non_blocking=True)
        # 3. the Markov head after the block pass: a graph replay where one was captured
        inputs = (ids.reshape(-1), self._slots(tab, pos), tab.int(), seq_lens, last, temps)
        if self.graphs is not None and s <= self.graphs.max_size:
            return self.graphs.run(*inputs)
        return block_drafts(self.model, kv, *inputs, self.sample_method, k, self.race_draws)

