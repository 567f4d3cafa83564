"""Draft-model proposer: a second, smaller KimiLinearForCausalLM with its own caches proposes K
tokens per request through the same forward contract as the target (AttentionMetadata +
ForwardContext + ModelCaches).

Each request owns, in the draft's caches, a *committed* KDA state slot (only tokens the target
has accepted ever enter it), a *scratch* slot, and its own MLA KV blocks. One `propose` call:
  1. catch-up: one forward over the request's committed tokens the draft has not seen yet (the
     whole prompt the first time; afterwards the accepted drafts + the bonus token) on the
     committed slot; its last logits give draft 1;
  2. the committed state is copied to the scratch slot, and K - 1 one-token forwards on the
     scratch slot give drafts 2..K.
Rejected drafts therefore leave no trace: the committed slot never saw them, and the KV they
wrote at positions >= the committed length is overwritten by the next catch-up before any
query reads it. A steady-state catch-up (1..K+1 new tokens on every row) runs as fixed K+1-row
windows in the verify form (spec_decode/draft_catchup.py; a CUDA graph on the GPU); the first
one, over the prompt, is a varlen prefill (as is every catch-up with catchup="varlen").

`propose_device` (async scheduling) does the same without the host knowing how many drafts
the target accepted. A request the draft has not seen runs the varlen catch-up over its host
tokens plus the token the step sampled (copied in on the device); every later step brings
exactly the tokens it emitted, which go through the window catch-up filled on the device
(`DraftCatchup.fill_device`: lengths and positions from the accepted counts), and drafts 2..K
run at positions computed on the device. The host keeps only an upper bound of each
request's length (for its blocks).

draft_sample_method: "greedy" (argmax; q is one-hot, the sampler gets draft_probs=None) or
"probabilistic" (sample from softmax(logits / T) with the request's temperature, T = 0 rows stay
argmax; returns q for the rejection sampler's ratio test).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from kdaserve.attention.builder import build_metadata
from kdaserve.attention.forward_context import ForwardContext
from kdaserve.attention.metadata import ModelCaches
from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.attention.caches import allocate_caches
from kdaserve.spec_decode.device_step import DeviceStep

if TYPE_CHECKING:
    from kdaserve.worker.cuda_graphs import CudaGraphManager

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


def draw_drafts(logits: torch.Tensor, temps: torch.Tensor, method: str,
                race: bool = False) -> torch.Tensor:
    """logits [n, V] fp32, temps [n] -> draft ids [n]. greedy (and T = 0 rows): the argmax;
    probabilistic: a draw from softmax(logits / T) as an exponential race on the logits,
    argmax(logits / T - log E) with E ~ Exp(1) i.i.d. (= argmax(q / E): category i wins with
    probability q_i). No softmax: a left-to-right drafter computes q once for all its
    positions (draft_probs), where a softmax per position is one slow launch per position.
    race (CUDA, LayerBackends.race_sampler): the race as one fused launch pair with in-kernel
    noise (kernels/sample/race.py) instead of a noise tensor and five ops over [n, V]."""
    if method == "greedy":
        return logits.argmax(dim=-1)
    if race and logits.is_cuda:
        from kdaserve.kernels.sample.race import race_sample

        seeds = torch.empty(logits.shape[0], dtype=torch.int64,
                            device=logits.device).random_(0, 2**62)
        return race_sample(logits, seeds, None, temps.float())
    sampled = temps >= 1e-5
    t = torch.where(sampled, temps, 1.0)
    noise = torch.empty_like(logits).exponential_().clamp_min_(1e-20).log_()  # no log 0
    return (logits / t[:, None] - noise * sampled[:, None]).argmax(dim=-1)


def draft_probs(logits: torch.Tensor, temps: torch.Tensor, ids: torch.Tensor,
                race: bool = False) -> torch.Tensor:
    """q [n, V] fp32 of probabilistic drafts: softmax(logits / T), one-hot at ids on T = 0
    rows (logits [n, V], temps [n], ids [n] from draw_drafts). race (CUDA): the row-split
    softmax of kernels/sample/softmax.py, the one-hot rows in the same pass."""
    if race and logits.is_cuda:
        from kdaserve.kernels.sample.softmax import tempered_softmax

        return tempered_softmax(logits, temps.float(), ids)
    greedy = temps < 1e-5
    q = torch.softmax(logits / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
    return torch.where(greedy[:, None],
                       torch.nn.functional.one_hot(ids, q.shape[-1]).to(q.dtype), q)


def sample_drafts(logits: torch.Tensor, temps: torch.Tensor, method: str, race: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [n, V] fp32, temps [n] -> (draft ids [n], q [n, V] or None): draw_drafts, and
    draft_probs for probabilistic drafts (greedy: no q; T = 0 rows a one-hot q)."""
    ids = draw_drafts(logits, temps, method, race)
    return ids, None if method == "greedy" else draft_probs(logits, temps, ids, race)


@dataclass
class _DraftRequest:
    block_ids: list[int]
    slot: int
    scratch_slot: int
    num_computed: int = 0
    """Committed tokens whose KV and state are in the draft caches."""


@dataclass
class DraftProposal:
    draft_token_ids: list[list[int]]
    draft_probs: torch.Tensor | None = None
    """[sum K_i, V] fp32 in request order (probabilistic only)."""


@dataclass
class _Allocator:
    free: list[int] = field(default_factory=list)

    def take(self, n: int, what: str) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"draft model is out of {what}: need {n}, {len(self.free)} free")
        out, self.free = self.free[:n], self.free[n:]
        return out

    def give(self, ids: list[int]) -> None:
        self.free.extend(ids)


class DraftModelProposer:
    def __init__(self, model: nn.Module, args: KimiLinearArgs, num_speculative_tokens: int,
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device | str, dtype: torch.dtype,
                 draft_sample_method: str = "greedy", num_blocks: int | None = None,
                 catchup: str = "window", race_draws: bool = False) -> None:
        """race_draws: probabilistic drafts drawn and their q computed by the fused kernels of
        kernels/sample (race.py, softmax.py) on CUDA (LayerBackends.race_sampler)."""
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, "
                             f"got {draft_sample_method!r}")
        self.model, self.args = model, args
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.sample_method = draft_sample_method
        self.race_draws = race_draws
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_req = -(-(max_model_len + num_speculative_tokens) // block_size)
        num_blocks = num_blocks or max_num_seqs * self.max_blocks_per_req
        # 2 KDA slots per request (committed, scratch) + 1 for CUDA-graph padding rows
        self.caches: ModelCaches = allocate_caches(args, num_blocks, block_size,
                                                   2 * max_num_seqs + 1, dtype, self.device)
        self._blocks = _Allocator(list(range(num_blocks)))
        self._slots = _Allocator(list(range(2 * max_num_seqs)))
        self.requests: dict[str, _DraftRequest] = {}
        self.graphs = None
        """DraftDecodeGraphs of drafts 2..K once capture_graphs() ran (CUDA only)."""
        if catchup not in ("window", "varlen"):
            raise ValueError(f"catchup must be window or varlen, got {catchup!r}")
        self.catchup = None
        """DraftCatchup (catchup="window"): steady-state catch-ups as K+1-row windows."""
        self.device_proposals = catchup == "window"
        """propose_device works (it runs every later catch-up as a window)."""
        if catchup == "window":
            from kdaserve.spec_decode.draft_catchup import DraftCatchup

            self.catchup = DraftCatchup(model, self.caches, num_speculative_tokens,
                                        2 * max_num_seqs, block_size, self.max_blocks_per_req,
                                        max_num_seqs, max_model_len, self.device)

    @classmethod
    def from_pretrained(cls, path: str, target_args: KimiLinearArgs, **kwargs
                        ) -> DraftModelProposer:
        """Load the draft from an HF-style folder (speculative_config.model); kwargs as
        __init__ (without model / args), plus backends (the draft's layer backends, None for
        build_model's baseline set). The vocabularies must match."""
        import json
        import os

        from kdaserve.config import LoadConfig
        from kdaserve.models.loader import load_weights
        from kdaserve.models.registry import build_model, resolve_architecture

        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"draft model folder {path!r} has no config.json")
        with open(cfg_path) as f:
            hf = json.load(f)
        args = KimiLinearArgs.from_hf_config(hf)
        if args.vocab_size != target_args.vocab_size:
            raise ValueError(f"draft vocab_size {args.vocab_size} != target vocab_size "
                             f"{target_args.vocab_size}")
        model = build_model(args, kwargs["dtype"], kwargs["device"], resolve_architecture(hf),
                            kwargs.pop("backends", None))
        load_weights(model, path, LoadConfig())
        return cls(model, args, **kwargs)

    @torch.inference_mode()
    def warmup(self) -> None:
        """One prefill, then one step mixing a one-token row with a K+1-token catch-up row,
        on free slots and blocks (given back after): the draft model's kernels compile and
        autotune at start-up, not during the first requests' steps."""
        prompt = 2 * self.block_size + 3
        need = -(-(prompt + self.k + 1) // self.block_size)
        slots = self._slots.take(2, "state slots")
        blocks = [self._blocks.take(need, "KV blocks") for _ in range(2)]
        try:
            self._forward([[0] * prompt, [0] * prompt], [0, 0], blocks, slots)
            self._forward([[0], [0] * (self.k + 1)], [prompt, prompt], blocks, slots)
        finally:
            self._slots.give(slots)
            for b in blocks:
                self._blocks.give(b)

    def capture_graphs(self, graphs: "CudaGraphManager") -> None:
        """Capture CUDA graphs of the catch-up window and the one-token draft steps into
        `graphs` (call after the target's caches are allocated, like the target's graphs)."""
        from kdaserve.spec_decode.draft_graphs import DraftDecodeGraphs

        if self.device.type != "cuda":
            return
        if self.catchup is not None:
            self.catchup.capture(graphs)
        if self.k < 2:
            return
        self.graphs = DraftDecodeGraphs(self.model, self.caches, 2 * self.max_num_seqs,
                                        self.block_size, self.max_blocks_per_req,
                                        self.max_num_seqs, self.max_model_len, self.device)
        self.graphs.capture(graphs)

    # -----------------------------------------------------------------------------------------

    def free(self, req_id: str) -> None:
        """Drop a finished / aborted / preempted request (a preempted one restarts from its
        prompt on its next propose)."""
        req = self.requests.pop(req_id, None)
        if req is not None:
            self._blocks.give(req.block_ids)
            self._slots.give([req.slot, req.scratch_slot])

    @torch.inference_mode()
    def propose(self, req_ids: list[str], token_ids: list[list[int]],
                temperatures: list[float] | None = None,
                max_drafts: list[int] | None = None) -> DraftProposal:
        """token_ids[i]: request i's committed tokens (prompt + accepted outputs, the bonus token
        last). temperatures: per request (probabilistic only; None = all greedy). max_drafts:
        per-request caps (<= K), e.g. the tokens left before max_model_len."""
        n = len(req_ids)
        if len(token_ids) != n:
            raise ValueError(f"{n} req_ids but {len(token_ids)} token lists")
        if n == 0:
            return DraftProposal([])
        reqs = [self._get(rid, len(toks)) for rid, toks in zip(req_ids, token_ids)]
        for rid, req, toks in zip(req_ids, reqs, token_ids):
            if len(toks) <= req.num_computed:
                raise ValueError(f"request {rid!r}: {len(toks)} committed tokens but the draft "
                                 f"has already computed {req.num_computed}")
        temps = torch.tensor(temperatures if temperatures is not None else [0.0] * n,
                             dtype=torch.float32, device=self.device)

        # 1. catch-up on the committed slots (decodes first, as build_metadata expects)
        queries = [toks[r.num_computed:] for r, toks in zip(reqs, token_ids)]
        computed = [r.num_computed for r in reqs]
        windowed = self.catchup is not None and self.catchup.can_run([len(q) for q in queries],
                                                                     computed)
        if windowed:   # the window step also copies the committed states to the scratch slots
            logits = self.catchup.run(queries, computed, [r.block_ids for r in reqs],
                                      [r.slot for r in reqs],
                                      [r.scratch_slot for r in reqs])        # [n, V]
        else:
            logits = self._catch_up_varlen(queries, reqs)
        for r, toks in zip(reqs, token_ids):
            r.num_computed = len(toks)

        drafts, probs = [], []
        tok, q = self._sample(logits, temps)
        drafts.append(tok)
        probs.append(q)
        # 2. K - 1 single-token steps on scratch copies of the committed state
        if self.k > 1:
            if not windowed:
                self._copy_slots([r.slot for r in reqs], [r.scratch_slot for r in reqs])
            step = self._graph_steps(reqs) if self.graphs is not None and \
                n <= self.graphs.max_bs else None
            for j in range(1, self.k):
                if step is not None:
                    logits = step(drafts[-1], j + 1)
                else:
                    logits = self._forward([[t] for t in drafts[-1].tolist()],
                                           [r.num_computed + j - 1 for r in reqs],
                                           [r.block_ids for r in reqs],
                                           [r.scratch_slot for r in reqs])
                tok, q = self._sample(logits, temps)
                drafts.append(tok)
                probs.append(q)
        out = torch.stack(drafts, dim=1).tolist()                          # [n, K]
        caps = max_drafts if max_drafts is not None else [self.k] * n
        out = [d[:max(0, min(c, self.k))] for d, c in zip(out, caps)]
        if self.sample_method == "greedy":
            return DraftProposal(out)
        q_all = torch.stack(probs, dim=1)                                  # [n, K, V]
        rows = [q_all[i, :len(d)] for i, d in enumerate(out)]
        return DraftProposal(out, torch.cat(rows) if rows else None)

    @torch.inference_mode()
    def propose_device(self, step: DeviceStep) -> tuple[torch.Tensor | None,
                                                         torch.Tensor | None]:
        """K drafts per sampling row of `step`, on the device (see the module doc). Returns
        (drafts [S, K] int64, q [S, K, V] or None); (None, None) when S = 0."""
        rows, dev = step.sample_rows, self.device
        if not rows:
            return None, None
        if self.catchup is None:
            raise ValueError("device proposals need the window catch-up (draft_catchup "
                             "window)")
        s = len(rows)
        reqs, first, steady = [], [], []
        for j, i in enumerate(rows):
            rid = step.req_ids[i]
            known = rid in self.requests
            # the host's bound of the committed length after this step (one past
            # max_model_len when the step ends the request: the pool has room for it)
            req = self._get(rid, min(step.num_computed[i] + step.query_lens[i] + 1,
                                     self.max_model_len + 1), limit=self.max_model_len + 1)
            (steady if known else first).append(j)
            reqs.append(req)
        temps = torch.tensor(step.temperatures, dtype=torch.float32).to(dev, non_blocking=True)
        logits = torch.empty(s, self.args.vocab_size, dtype=torch.float32, device=dev)
        committed = torch.empty(s, dtype=torch.long, device=dev)   # lengths after this step
        start = step.start.index_select(0, self._tensor(rows))
        if first:   # 1. catch-up: the host tokens + the sampled one, varlen
            queries = [step.token_ids[rows[j]] + [0] for j in first]
            lens = [len(q) for q in queries]
            md = build_metadata(lens, [0] * len(first), [reqs[j].block_ids for j in first],
                                [reqs[j].slot for j in first], self.block_size, dev)
            ids = torch.tensor([t for q in queries for t in q], dtype=torch.long, device=dev)
            ids[md.query_start_loc[1:].long() - 1] = step.last.index_select(0,
                                                                       self._tensor(first))
            hidden = self.model(ids, ForwardContext(md, self.caches))
            idx = self._tensor(first)
            logits.index_copy_(0, idx, self.model.compute_logits(
                hidden[(md.query_start_loc[1:] - 1).long()]))
            committed.index_copy_(0, idx, self._tensor(lens))
            self._copy_slots([reqs[j].slot for j in first],
                             [reqs[j].scratch_slot for j in first])
        if steady:  # the tokens this step emitted, in K+1-row windows (also copies to scratch)
            idx = self._tensor(steady)
            num = step.num_emitted.index_select(0, idx)
            computed = start.index_select(0, idx) + 1
            logits.index_copy_(0, idx, self.catchup.run_device(
                step.emitted.index_select(0, idx), num, computed,
                [reqs[j].block_ids for j in steady], [reqs[j].slot for j in steady],
                [reqs[j].scratch_slot for j in steady]))
            committed.index_copy_(0, idx, computed + num)
        for r in reqs:
            r.num_computed = 1   # started: later proposals take the window catch-up
        drafts, probs = [], []
        tok, q = self._sample(logits, temps)
        drafts.append(tok)
        probs.append(q)
        # 2. K - 1 one-token steps on the scratch slots, at positions from the device
        if self.k > 1:
            width = max(len(r.block_ids) for r in reqs)
            table = np.zeros((s, width), dtype=np.int32)
            for i, r in enumerate(reqs):
                table[i, :len(r.block_ids)] = r.block_ids
            use_graphs = self.graphs is not None and s <= self.graphs.max_bs
            if use_graphs:
                self.graphs.load(table, [r.scratch_slot for r in reqs])
            tab = torch.from_numpy(table).to(dev, non_blocking=True).long()
            bound = [step.num_computed[i] + step.query_lens[i] + 1 for i in rows]
            for j in range(1, self.k):
                pos = committed + j - 1                                        # [S]
                slots = (tab.gather(1, (pos // self.block_size).clamp(max=width - 1)[:, None])
                         .squeeze(1) * self.block_size + pos % self.block_size)
                if use_graphs:
                    logits = self.graphs.step_device(drafts[-1], pos + 1, slots)
                else:
                    md = build_metadata([1] * s, [b + j - 1 for b in bound],
                                        [r.block_ids for r in reqs],
                                        [r.scratch_slot for r in reqs], self.block_size, dev)
                    md.seq_lens.copy_(pos + 1)
                    md.slot_mapping.copy_(slots)
                    hidden = self.model(drafts[-1], ForwardContext(md, self.caches))
                    logits = self.model.compute_logits(hidden)
                tok, q = self._sample(logits, temps)
                drafts.append(tok)
                probs.append(q)
        q_all = None if self.sample_method == "greedy" else torch.stack(probs, dim=1)
        return torch.stack(drafts, dim=1), q_all

    def _tensor(self, xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long).to(self.device, non_blocking=True)

    # -----------------------------------------------------------------------------------------

    def _get(self, req_id: str, num_tokens: int, limit: int | None = None) -> _DraftRequest:
        if num_tokens > (limit or self.max_model_len):
            raise ValueError(f"request {req_id!r} has {num_tokens} tokens, over the draft's "
                             f"max_model_len {self.max_model_len}")
        req = self.requests.get(req_id)
        if req is None:
            slot, scratch = self._slots.take(2, "state slots")
            req = _DraftRequest([], slot, scratch)
            self.requests[req_id] = req
        need = -(-(num_tokens + self.k - 1) // self.block_size)
        if need > len(req.block_ids):
            req.block_ids.extend(self._blocks.take(need - len(req.block_ids), "KV blocks"))
        return req

    def _graph_steps(self, reqs: list[_DraftRequest]):
        """Load the rows into the draft graphs; returns step(prev_tokens, j) -> logits [n, V]
        for draft j (2..K): it feeds token j - 1 at position num_computed + j - 2."""
        from kdaserve.spec_decode.draft_graphs import step_inputs

        width = max(len(r.block_ids) for r in reqs)
        table = np.zeros((len(reqs), width), dtype=np.int32)
        for i, r in enumerate(reqs):
            table[i, :len(r.block_ids)] = r.block_ids
        self.graphs.load(table, [r.scratch_slot for r in reqs])
        computed = np.asarray([r.num_computed for r in reqs], dtype=np.int64)

        def step(prev: torch.Tensor, j: int) -> torch.Tensor:
            seq, slots = step_inputs(computed, table, self.block_size, j - 1)
            return self.graphs.step(prev, seq, slots)
        return step

    def _catch_up_varlen(self, queries: list[list[int]], reqs: list[_DraftRequest]
                         ) -> torch.Tensor:
        """The baseline catch-up: one varlen forward over exactly the new tokens (decodes first,
        as build_metadata expects); logits [n, V] in request order."""
        n = len(reqs)
        order = sorted(range(n), key=lambda i: not (len(queries[i]) == 1
                                                    and reqs[i].num_computed > 0))
        logits = self._forward([queries[i] for i in order], [reqs[i].num_computed for i in order],
                               [reqs[i].block_ids for i in order], [reqs[i].slot for i in order])
        inv = torch.empty(n, dtype=torch.long)
        inv[torch.tensor(order)] = torch.arange(n)
        return logits[inv.to(self.device)]

    def _forward(self, queries: list[list[int]], num_computed: list[int],
                 block_ids: list[list[int]], slots: list[int]) -> torch.Tensor:
        """One forward; returns fp32 logits [len(queries), V] at each query's last token."""
        md = build_metadata([len(x) for x in queries], num_computed, block_ids, slots,
                            self.block_size, self.device)
        ids = torch.tensor([t for x in queries for t in x], dtype=torch.long, device=self.device)
        hidden = self.model(ids, ForwardContext(md, self.caches))
        last = (md.query_start_loc[1:] - 1).long()
        return self.model.compute_logits(hidden[last])

    def _sample(self, logits: torch.Tensor, temps: torch.Tensor):
        return sample_drafts(logits, temps, self.sample_method, self.race_draws)

    def _copy_slots(self, src: list[int], dst: list[int]) -> None:
        s, d = self._tensor(src), self._tensor(dst)   # staged: no wait for the device
        for pool in (*self.caches.kda_recurrent, *self.caches.kda_conv):
            pool.index_copy_(0, d, pool.index_select(0, s))
