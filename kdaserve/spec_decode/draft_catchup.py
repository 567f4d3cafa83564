"""The draft model's steady-state catch-up as one fixed-shape step (CUDA-graph replay on the GPU).

After a verification, each request has 1..K+1 committed tokens the draft has not seen (the
accepted drafts and the bonus token). The plain path runs them as a varlen prefill: about ten
launches per KDA layer, prefill attention per request, and Python launch overhead that made it
most of a speculative step's time (benchmarks/PERF_NOTES.md). Here every
request gets a window of exactly K+1 token rows, its new tokens first and padding after, and the
step runs in the RecoverSSM verify form the target's verification already uses:
- KDA: the verify kernels read the committed state (read only) and keep per-token records; the
  commit, inside the same step, folds exactly each row's `n_real` tokens into its committed slot,
  so the padding tokens leave no trace;
- MLA: one absorbed row per token; a real token j sees its context and tokens 0..j, a padding
  token only its row's context (its output is never used), and padding writes no KV;
- the logits are taken at each row's last real token;
- each committed state is then copied to the row's scratch slot, where drafts 2..K run (eagerly
  that copy is two launches per cache tensor and two host syncs a step).
Rows past n (up to the capture size) run on the draft's padding slot and commit nothing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from kdaserve.attention import kda_spec
from kdaserve.attention.builder import slot_mapping
from kdaserve.attention.forward_context import (BatchDescriptor, ExecMode, ForwardContext,
                                                StepPlan, capture_sizes)
from kdaserve.attention.metadata import ModelCaches
from kdaserve.spec_decode.verify_graphs import WindowBuffers

if TYPE_CHECKING:
    from kdaserve.worker.cuda_graphs import CudaGraphManager

logger = logging.getLogger(__name__)


class DraftCatchup(WindowBuffers):
    """Buffers, the step's work, and (CUDA) one graph per capture size. On the CPU, run() does
    the same work eagerly (the test path of everything but the capture)."""

    def __init__(self, model: nn.Module, caches: ModelCaches, k: int, pad_slot: int,
                 block_size: int, max_blocks: int, max_num_seqs: int, max_seq_len: int,
                 device: torch.device) -> None:
        self.model, self.caches = model, caches
        self.pad_slot, self.block_size = pad_slot, block_size
        self.sizes = capture_sizes(max_num_seqs)
        super().__init__(self.sizes[-1], k + 1, max_blocks, pad_slot, max_seq_len, device)
        bs = self.max_bs
        self.scratch_indices = torch.full((bs,), pad_slot, dtype=torch.long, device=device)
        self.num_real = torch.zeros(bs, dtype=torch.int64, device=device)       # commit counts
        self.last_row = torch.zeros(bs, dtype=torch.long, device=device)        # logits rows
        self.graphs: "CudaGraphManager | None" = None
        """The manager holding this step's graphs, once capture() ran (CUDA)."""
        self.num_runs = 0

    def descriptor(self, bs: int) -> BatchDescriptor:
        return BatchDescriptor(ExecMode.DRAFT_GRAPH, bs, self.k1)

    def can_run(self, new_tokens: list[int], num_computed: list[int]) -> bool:
        """Every row continues a context with 1..K+1 new tokens, and the rows fit a size."""
        return (0 < len(new_tokens) <= self.max_bs and all(c > 0 for c in num_computed)
                and all(1 <= n <= self.k1 for n in new_tokens))

    # ---- the step's work ----
    def _forward(self, bs: int) -> torch.Tensor:
        """Forward over bs * (K+1) rows, commit of the real tokens; fp32 logits [bs, V] at each
        row's last real token."""
        md = self._metadata(bs)
        t = bs * self.k1
        self._token_block_tables(bs)
        md.spec.records.clear()
        md.spec.conv_inputs.clear()
        # the draft model runs the baseline backends: no PDL
        plan = StepPlan.graph(self.descriptor(bs), pdl=False)
        hidden = self.model(self.input_ids[:t], ForwardContext(md, self.caches, plan))  # [t, D]
        logits = self.model.compute_logits(hidden.index_select(0, self.last_row[:bs]))
        kda_spec.commit(md.spec, self.caches.kda_recurrent, self.caches.kda_conv,
                        self.num_real[:bs])
        src, dst = self.state_indices[:bs].long(), self.scratch_indices[:bs]
        for pool in (*self.caches.kda_recurrent, *self.caches.kda_conv):
            pool.index_copy_(0, dst, pool.index_select(0, src))
        return logits

    @torch.inference_mode()
    def capture(self, graphs: "CudaGraphManager") -> None:
        """One graph per capture size (CUDA). The warm-up runs commit zero tokens into the
        padding slot: the buffers hold padding rows until the first fill()."""
        t0 = time.perf_counter()
        for bs in reversed(self.sizes):
            graphs.capture(self.descriptor(bs), lambda: self._forward(bs))
        self.graphs = graphs
        torch.cuda.synchronize()
        logger.info("captured %d draft catch-up CUDA graphs (sizes %s, %d rows per request) in "
                    "%.1f s", len(self.sizes), self.sizes, self.k1, time.perf_counter() - t0)

    # ---- one step ----
    def fill(self, queries: list[list[int]], num_computed: list[int],
             block_ids: list[list[int]], slots: list[int], scratch_slots: list[int]) -> int:
        """Write the rows into the buffers; returns the capture size."""
        n, k1 = len(queries), self.k1
        bs = next(s for s in self.sizes if s >= n)
        lens = np.asarray([len(q) for q in queries], dtype=np.int64)             # [n]
        computed = np.asarray(num_computed, dtype=np.int64)                      # [n]
        off = np.arange(k1)
        real = off[None, :] < lens[:, None]                                      # [n, k1]
        pos = computed[:, None] + off[None, :]                                   # [n, k1]
        width = max(len(b) for b in block_ids)
        table = np.zeros((bs, width), dtype=np.int32)
        for i, b in enumerate(block_ids):
            table[i, :len(b)] = b
        req = np.repeat(np.arange(n), k1)
        slots_np = np.full(bs * k1, -1, dtype=np.int64)
        slots_np[:n * k1] = np.where(real.reshape(-1),
                                     slot_mapping(table, req, np.minimum(
                                         pos, computed[:, None] + lens[:, None] - 1).reshape(-1),
                                                  self.block_size), -1)
        ids = np.zeros(bs * k1, dtype=np.int64)
        ids.reshape(bs, k1)[:n][real] = [t for q in queries for t in q]
        mla_seq = np.ones(bs * k1, dtype=np.int32)
        # a real token sees tokens up to itself; padding only its row's context
        mla_seq[:n * k1] = np.where(real, pos + 1, computed[:, None]).reshape(-1)
        seq = np.ones(bs, dtype=np.int32)
        seq[:n] = computed + lens
        state = np.full(bs, self.pad_slot, dtype=np.int32)
        state[:n] = slots
        scratch = np.full(bs, self.pad_slot, dtype=np.int64)
        scratch[:n] = scratch_slots
        n_real = np.zeros(bs, dtype=np.int64)
        n_real[:n] = lens
        last = np.arange(bs, dtype=np.int64) * k1
        last[:n] += lens - 1
        for buf, val in ((self.input_ids, ids), (self.slot_mapping, slots_np),
                         (self.mla_seq_lens, mla_seq), (self.seq_lens, seq),
                         (self.state_indices, state), (self.scratch_indices, scratch),
                         (self.num_real, n_real),
                         (self.last_row, last)):
            buf[:val.shape[0]].copy_(torch.from_numpy(val), non_blocking=True)
        self.block_table[:bs, :width].copy_(torch.from_numpy(table), non_blocking=True)
        self.block_table[n:bs, :width] = 0
        return bs

    def fill_device(self, tokens: torch.Tensor, lens: torch.Tensor, computed: torch.Tensor,
                    block_ids: list[list[int]], slots: list[int], scratch_slots: list[int]
                    ) -> int:
        """fill() from device values (async scheduling: the host does not know how many
        tokens each row brings): tokens [n, >= 1] left-aligned (garbage past lens), lens [n]
        and computed [n] int64 on the device; block_ids, slots on the host. Returns the
        capture size."""
        n, k1, dev = len(block_ids), self.k1, self.input_ids.device
        bs = next(s for s in self.sizes if s >= n)
        width = max(len(b) for b in block_ids)
        table = np.zeros((bs, width), dtype=np.int32)
        for i, b in enumerate(block_ids):
            table[i, :len(b)] = b
        self.block_table[:bs, :width].copy_(torch.from_numpy(table), non_blocking=True)
        self.block_table[n:bs, :width] = 0
        lens_bs = torch.zeros(bs, dtype=torch.long, device=dev)
        lens_bs[:n] = lens
        comp_bs = torch.zeros(bs, dtype=torch.long, device=dev)
        comp_bs[:n] = computed
        off = torch.arange(k1, device=dev)
        real = off[None, :] < lens_bs[:, None]                                  # [bs, k1]
        pos = comp_bs[:, None] + off[None, :]                                   # [bs, k1]
        ids = torch.zeros(bs, k1, dtype=torch.long, device=dev)
        w = min(k1, tokens.shape[1])
        ids[:n, :w] = tokens[:, :w].clamp(min=0)
        col = (pos // self.block_size).clamp(max=width - 1)
        tab = self.block_table[:bs, :width].long()
        kv_slot = tab.gather(1, col) * self.block_size + pos % self.block_size
        self.input_ids[:bs * k1].copy_(torch.where(real, ids, 0).reshape(-1))
        self.slot_mapping[:bs * k1].copy_(torch.where(real, kv_slot, -1).reshape(-1))
        # a real token sees tokens up to itself; padding only its row's context (>= 1)
        seq = torch.where(real, pos + 1, comp_bs[:, None].clamp(min=1))
        self.mla_seq_lens[:bs * k1].copy_(seq.reshape(-1))
        self.seq_lens[:bs].copy_((comp_bs + lens_bs).clamp(min=1))
        state = np.full(bs, self.pad_slot, dtype=np.int32)
        state[:n] = slots
        scratch = np.full(bs, self.pad_slot, dtype=np.int64)
        scratch[:n] = scratch_slots
        self.state_indices[:bs].copy_(torch.from_numpy(state), non_blocking=True)
        self.scratch_indices[:bs].copy_(torch.from_numpy(scratch), non_blocking=True)
        self.num_real[:bs].copy_(lens_bs)
        self.last_row[:bs].copy_(torch.arange(bs, device=dev) * k1 + (lens_bs - 1).clamp(min=0))
        return bs

    @torch.inference_mode()
    def run_device(self, tokens: torch.Tensor, lens: torch.Tensor, computed: torch.Tensor,
                   block_ids: list[list[int]], slots: list[int], scratch_slots: list[int]
                   ) -> torch.Tensor:
        """run() over fill_device's inputs: fp32 logits [n, V] at each row's last new token."""
        n = len(block_ids)
        bs = self.fill_device(tokens, lens, computed, block_ids, slots, scratch_slots)
        self.num_runs += 1
        if self.graphs is not None:
            return self.graphs.replay(self.descriptor(bs))[:n]
        return self._forward(bs)[:n]

    @torch.inference_mode()
    def run(self, queries: list[list[int]], num_computed: list[int],
            block_ids: list[list[int]], slots: list[int], scratch_slots: list[int]
            ) -> torch.Tensor:
        """The catch-up of len(queries) rows (can_run holds): each row's new tokens go into its
        committed slot, and the committed state is copied to its scratch slot. Returns fp32
        logits [n, V] at each row's last new token (a view of a graph output on CUDA: use it
        before the next run)."""
        n = len(queries)
        bs = self.fill(queries, num_computed, block_ids, slots, scratch_slots)
        self.num_runs += 1
        if self.graphs is not None:
            return self.graphs.replay(self.descriptor(bs))[:n]
        return self._forward(bs)[:n]
