"""CUDA graphs for speculative verification steps.

A step qualifies when every request verifies exactly K drafts (1 + K tokens on a non-empty
context), with the contiguous batch layout and the RecoverSSM state mode, and exports no prefix
checkpoint: the steady state of speculative decoding. One graph per capture size B (requests)
covers the whole forward over B * (1 + K) tokens:
- KDA runs the verify kernels (the state pool is read only; the records they keep belong to the
  graph and feed the commit after sampling);
- MLA runs one absorbed row per token; its per-token block table and sequence lengths are
  derived inside the graph from the per-request buffers.
Padding requests (up to the capture size) verify on the runner's scratch KDA slot, write no KV
and commit nothing that matters (zero accepted tokens, into the scratch slot).

The commit after sampling is a second graph per size over the forward graph's records: the
accepted counts are its only input (two Triton launches per KDA layer otherwise, ~2.8 ms of
host time per step at 20 layers on the H200).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from kdaserve.attention import kda_spec
from kdaserve.attention.metadata import (AttentionMetadata, ForwardContext, MLAAbsorbedRows,
                                         SpecStep)
from kdaserve.attention.builder import slot_mapping
from kdaserve.worker.cuda_graphs import capture_graph, capture_sizes

if TYPE_CHECKING:
    from kdaserve.worker.model_runner import CachedRequestState, ModelRunner, StepBatch

logger = logging.getLogger(__name__)


class WindowBuffers:
    """Device buffers of a step of up to max_bs requests with k1 token rows each, and its
    metadata: KDA in the RecoverSSM verify form, MLA one absorbed row per token. Shared by the
    target's verification graphs and the draft model's catch-up windows. Padding requests (up
    to a capture size) use pad_slot and write no KV (slot_mapping -1)."""

    def __init__(self, max_bs: int, k1: int, max_blocks: int, pad_slot: int, max_seq_len: int,
                 device: torch.device) -> None:
        self.max_bs, self.k1, self.max_seq_len = max_bs, k1, max_seq_len
        tok = max_bs * k1
        self.input_ids = torch.zeros(tok, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(0, (max_bs + 1) * k1, k1, dtype=torch.int32,
                                            device=device)
        self.seq_lens = torch.full((max_bs,), k1, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((tok,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        self.state_indices = torch.full((max_bs,), pad_slot, dtype=torch.int32, device=device)
        self.has_initial_state = torch.ones(max_bs, dtype=torch.bool, device=device)
        self.token_req = torch.arange(tok, device=device) // k1           # [tok]: its request
        self.mla_seq_lens = torch.ones(tok, dtype=torch.int32, device=device)
        self.mla_block_table = torch.zeros(tok, max_blocks, dtype=torch.int32, device=device)
        self._md: dict[int, AttentionMetadata] = {}

    def _metadata(self, bs: int) -> AttentionMetadata:
        """The metadata of bs requests over the buffers (built once per size)."""
        md = self._md.get(bs)
        if md is not None:
            return md
        t, k1 = bs * self.k1, self.k1
        md = AttentionMetadata(
            num_reqs=bs, num_decodes=0, num_actual_tokens=t,
            query_start_loc=self.query_start_loc[:bs + 1],
            query_start_loc_cpu=torch.arange(0, (bs + 1) * k1, k1, dtype=torch.int32),
            seq_lens=self.seq_lens[:bs], seq_lens_cpu=torch.full((bs,), k1, dtype=torch.int32),
            num_computed_tokens_cpu=torch.ones(bs, dtype=torch.int32),
            slot_mapping=self.slot_mapping[:t], block_table=self.block_table[:bs],
            state_indices=self.state_indices[:bs], has_initial_state=self.has_initial_state[:bs],
            max_query_len=k1, max_seq_len=self.max_seq_len)
        md.spec = SpecStep("contiguous", False, 0, self.query_start_loc[:bs + 1],
                           self.state_indices[:bs], None)
        md.mla_absorbed = MLAAbsorbedRows(list(range(bs)), 0, None, self.mla_seq_lens[:t],
                                          self.mla_block_table[:t])
        self._md[bs] = md
        return md

    def _token_block_tables(self, bs: int) -> None:
        """Each token row's block table from its request's (inside the captured work)."""
        t = bs * self.k1
        self.mla_block_table[:t] = self.block_table.index_select(0, self.token_req[:t])


class SpecVerifyGraphs(WindowBuffers):
    def __init__(self, runner: "ModelRunner", pool=None) -> None:
        spec = runner.spec
        if spec.per_position or spec.layout != "contiguous":
            raise ValueError("spec verification graphs need kda_state_mode=recover and "
                             "batch_layout=contiguous")
        self.runner, self.spec, self.pool = runner, spec, pool
        self.sizes = capture_sizes(runner.config.scheduler_config.max_num_seqs)
        max_len = runner.config.scheduler_config.max_model_len
        super().__init__(self.sizes[-1], spec.k + 1, -(-(max_len + spec.k) // runner.block_size),
                         runner.num_slots, max_len, runner.device)
        tok = self.max_bs * self.k1
        # per token: its offset in the window (for the absorbed MLA rows' sequence lengths)
        self.token_off = (torch.arange(tok, device=runner.device) % self.k1).to(torch.int32)
        self.num_accepted = torch.zeros(self.max_bs, dtype=torch.int64, device=runner.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, SpecStep]] = {}
        self.commit_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0

    # ---- capture ----
    def _forward(self, bs: int, md: AttentionMetadata) -> torch.Tensor:
        """The captured work: per-token MLA inputs from the per-request buffers, then the
        model over bs * (1 + K) tokens."""
        t = bs * self.k1
        self._token_block_tables(bs)
        # token j of a window sees the context before the step plus window tokens 0..j
        self.mla_seq_lens[:t] = self.seq_lens.index_select(0, self.token_req[:t]) \
            - (self.k1 - 1) + self.token_off[:t]
        md.spec.records.clear()
        md.spec.conv_inputs.clear()
        ids = self.input_ids[:t]
        return self.runner.model(ids, ids, ForwardContext(md, self.runner.caches))

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        for bs in reversed(self.sizes):
            md = self._metadata(bs)
            graph, hidden = capture_graph(lambda: self._forward(bs, md), self.pool)
            self.pool = self.pool or graph.pool()
            self.graphs[bs] = (graph, hidden, md.spec)
            # the buffers hold padding rows here: the warm-up commits zero tokens to scratch
            self.commit_graphs[bs], _ = capture_graph(lambda: self._commit_work(bs, md.spec),
                                                      self.pool, warmups=1)
        torch.cuda.synchronize()
        logger.info("captured %d spec-verify CUDA graphs (sizes %s, %d tokens per request) in "
                    "%.1f s", len(self.graphs), self.sizes, self.k1, time.perf_counter() - t0)

    # ---- replay ----
    def can_run(self, batch: "StepBatch") -> bool:
        n = len(batch.req_ids)
        return (0 < n <= self.max_bs and all(len(d) == self.k1 - 1 for d in batch.drafts)
                and all(c > 0 for c in batch.num_computed))

    def fill(self, batch: "StepBatch", states: list["CachedRequestState"]) -> int:
        """Write the step into the buffers; returns the capture size."""
        n = len(batch.req_ids)
        bs = next(s for s in self.sizes if s >= n)
        k1, bsz, t = self.k1, self.runner.block_size, n * self.k1
        computed = np.asarray(batch.num_computed, dtype=np.int64)
        pos = (computed[:, None] + np.arange(k1)[None, :]).reshape(-1)          # [t]
        req = np.repeat(np.arange(n), k1)
        width = max(len(s.block_ids) for s in states)
        table = np.zeros((bs, width), dtype=np.int32)
        for i, s in enumerate(states):
            table[i, :len(s.block_ids)] = s.block_np[:len(s.block_ids)]
        slots = np.full(bs * k1, -1, dtype=np.int64)
        slots[:t] = slot_mapping(table, req, pos, bsz)
        ids = np.zeros(bs * k1, dtype=np.int64)
        ids[:t] = batch.input_ids
        seq = np.full(bs, k1, dtype=np.int32)
        seq[:n] = computed + k1
        state = np.full(bs, self.runner.num_slots, dtype=np.int32)
        state[:n] = [s.state_slot for s in states]
        self.input_ids[:bs * k1].copy_(torch.from_numpy(ids))
        self.slot_mapping[:bs * k1].copy_(torch.from_numpy(slots))
        self.seq_lens[:bs].copy_(torch.from_numpy(seq))
        self.state_indices[:bs].copy_(torch.from_numpy(state))
        self.block_table[:bs, :width].copy_(torch.from_numpy(table))
        return bs

    def run(self, batch: "StepBatch", states: list["CachedRequestState"]) -> torch.Tensor:
        """Hidden states of every window token [n * (1 + K), D]; the pending commit is set."""
        bs = self.fill(batch, states)
        hidden, step = self._run(bs)
        self.num_replays += 1
        n = len(batch.req_ids)
        self.spec.set_pending(step, [s.state_slot for s in states], pad_to=bs,
                              commit=lambda accepted: self.commit(bs, step, accepted))
        return hidden[:n * self.k1]

    def _commit_work(self, bs: int, step: SpecStep) -> None:
        """The captured commit: the first num_accepted[i] window tokens into row i's slot."""
        caches = self.runner.caches
        kda_spec.commit(step, caches.kda_recurrent, caches.kda_conv, self.num_accepted[:bs])

    def commit(self, bs: int, step: SpecStep, num_accepted: list[int]) -> None:
        """After sampling the step replayed at size bs: num_accepted per real row (padding
        rows commit zero)."""
        n = np.zeros(bs, dtype=np.int64)
        n[:len(num_accepted)] = num_accepted
        self.num_accepted[:bs].copy_(torch.from_numpy(n), non_blocking=True)
        self._replay_commit(bs, step)

    def _replay_commit(self, bs: int, step: SpecStep) -> None:
        self.commit_graphs[bs].replay()

    def _run(self, bs: int) -> tuple[torch.Tensor, SpecStep]:
        graph, hidden, step = self.graphs[bs]
        graph.replay()
        return hidden, step
