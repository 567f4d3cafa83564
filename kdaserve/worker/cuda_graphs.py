"""CUDA graphs: one manager for every graph the engine replays, and the decode graphs' inputs.

The manager keys each graph by its BatchDescriptor (execution mode, padded request count, tokens
per request, stage) and serves the target's decode and verification graphs and the draft
model's graphs alike: each user captures a piece of work at each capture size, then replays the
graph of the smallest size that holds its batch. Padding rows compute on a scratch KDA slot,
write no KV (slot_mapping -1) and are dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kdaserve.attention.builder import StepBuffers
from kdaserve.attention.dcp import DCPGroup, DCPMetadata
from kdaserve.attention.dcp import slot_mapping as dcp_slot_mapping
from kdaserve.attention.forward_context import (BatchDescriptor, ExecMode, ForwardContext,
                                                StepPlan, capture_sizes)
from kdaserve.attention.metadata import AttentionMetadata, ModelCaches

if TYPE_CHECKING:
    from kdaserve.worker.input_batch import CachedRequestState, StepBatch

logger = logging.getLogger(__name__)


class CudaGraphManager:
    """Captured graphs by BatchDescriptor, with their outputs. Two memory pools: one for the
    target model's graphs, one for the draft model's, whose replays fall between a
    verification forward and its commit's consumers. Within a pool, graphs are replayed one at
    a time and each output is used before another graph of the pool replays."""

    def __init__(self, max_num_seqs: int, pdl: bool) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        self.pdl = pdl
        """Graphs launch their Triton kernels with PDL (the plan each is captured with)."""
        self._graphs: dict[BatchDescriptor, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._pools: dict[bool, Any] = {}

    def padded_size(self, num_reqs: int) -> int | None:
        """The capture size a batch of num_reqs requests replays at (None: too many)."""
        return next((s for s in self.sizes if s >= num_reqs), None)

    def plan(self, batch: BatchDescriptor) -> StepPlan:
        """The plan a target-model graph of `batch` is captured with."""
        return StepPlan.graph(batch, pdl=self.pdl)

    def __contains__(self, batch: BatchDescriptor) -> bool:
        return batch in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def batches(self) -> list[BatchDescriptor]:
        """The descriptors of the captured graphs, in capture order."""
        return list(self._graphs)

    def capture(self, batch: BatchDescriptor, work: Callable[[], Any], warmups: int = 2) -> Any:
        """Run `work` eagerly `warmups` times (autotuning and lazy init stay out of the
        capture), capture it, and replay it once so that the graph's upload happens at
        start-up, not in the first serving step of its size. Returns what work returned in the
        capture: the graph's output, which each replay rewrites."""
        for _ in range(warmups):
            work()
        torch.cuda.synchronize()
        draft = batch.mode is ExecMode.DRAFT_GRAPH
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pools.get(draft)):
            out = work()
        self._pools.setdefault(draft, graph.pool())
        graph.replay()
        self._graphs[batch] = (graph, out)
        return out

    def replay(self, batch: BatchDescriptor) -> Any:
        graph, out = self._graphs[batch]
        graph.replay()
        return out

    def graph(self, batch: BatchDescriptor) -> torch.cuda.CUDAGraph:
        return self._graphs[batch][0]


class _HostStaging:
    """Pinned host copies of the decode graph's inputs, with numpy views to fill them."""

    def __init__(self, bs: int, max_blocks: int) -> None:
        self.ids = torch.zeros(bs, dtype=torch.long).pin_memory()
        self.seq = torch.ones(bs, dtype=torch.int32).pin_memory()
        self.slot = torch.full((bs,), -1, dtype=torch.int64).pin_memory()
        self.table = torch.zeros(bs, max_blocks, dtype=torch.int32).pin_memory()
        self.state = torch.zeros(bs, dtype=torch.int32).pin_memory()
        self.n_ids, self.n_seq, self.n_slot = self.ids.numpy(), self.seq.numpy(), self.slot.numpy()
        self.n_state, self.n_table = self.state.numpy(), self.table.numpy()
        self.local = torch.ones(bs, dtype=torch.int32).pin_memory()   # DCP: local lengths
        self.n_local = self.local.numpy()


class DecodeGraphs(StepBuffers):
    """The target's decode-only steps: graph input buffers, their host staging, and the
    captured forward at every capture size."""

    def __init__(self, graphs: CudaGraphManager, model: torch.nn.Module, caches: ModelCaches,
                 pad_slot: int, block_size: int, max_model_len: int,
                 device: torch.device, dcp: DCPGroup | None = None,
                 hidden_outputs: dict | None = None) -> None:
        """dcp: decode context parallelism (attention/dcp.py): the graphs store only this
        rank's positions and attend over its shard (local lengths in local_seq_lens), with the
        group's collectives captured inside. hidden_outputs: the model's keyword arguments
        that make it also return the hidden states a drafter reads (return_prenorm and
        aux_layers: the MTP and DSpark drafters), captured as a second output."""
        self.graphs, self.model, self.caches = graphs, model, caches
        self.hidden_outputs = hidden_outputs or {}
        self.block_size, self.sizes = block_size, graphs.sizes
        self.dcp = dcp
        max_blocks = -(-max_model_len // block_size)
        super().__init__(graphs.max_size, 1, max_blocks, pad_slot, max_model_len, device)
        self.local_seq_lens = (torch.ones(self.max_bs, dtype=torch.int32, device=device)
                               if dcp is not None else None)
        # Host staging (pinned): one H2D copy per buffer per step. Two sets, used in turn: with
        # async scheduling a step fills its inputs while the previous step's copies may still
        # be queued behind the device work before them.
        self._staging = [_HostStaging(self.max_bs, max_blocks) for _ in range(2)]
        self._turn = 0

    @staticmethod
    def descriptor(bs: int) -> BatchDescriptor:
        return BatchDescriptor(ExecMode.DECODE_GRAPH, bs)

    def decode_metadata(self, bs: int) -> AttentionMetadata:
        md = super().decode_metadata(bs)
        if self.dcp is not None:
            md.dcp = DCPMetadata(self.dcp, self.local_seq_lens[:bs])
        return md

    def _work(self, bs: int) -> tuple[BatchDescriptor, Callable[[], Any]]:
        """The graph of capture size bs: its descriptor and its forward."""
        desc = self.descriptor(bs)
        ctx = ForwardContext(self.decode_metadata(bs), self.caches, self.graphs.plan(desc))
        ids = self.input_ids[:bs]
        return desc, lambda: self.model(ids, ctx, **self.hidden_outputs)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        for bs in reversed(self.sizes):
            self.graphs.capture(*self._work(bs))
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (sizes %s) in %.1f s", len(self.sizes),
                    self.sizes, time.perf_counter() - t0)

    @torch.inference_mode()
    def run_uncaptured(self) -> None:
        """Every capture size's forward once, eagerly, with the plan its graph is captured
        with (the kernel variants a capture launches, compiled ahead: worker.py)."""
        for bs in reversed(self.sizes):
            self._work(bs)[1]()

    def can_run(self, batch: "StepBatch") -> bool:
        n = len(batch.req_ids)
        return (n <= self.max_bs and all(q == 1 for q in batch.query_lens)
                and all(c > 0 for c in batch.num_computed))

    def fill_host_inputs(self, batch: "StepBatch", states: list["CachedRequestState"]
                         ) -> tuple[int, int]:
        """Write one decode step into the pinned host buffers (numpy views: no per-element
        torch calls). Padding rows up to the capture size read one token of block 0 with the
        scratch KDA slot and write no KV. Returns (capture size, block-table width)."""
        n = len(batch.req_ids)
        bs = next(s for s in self.sizes if s >= n)
        bsz = self.block_size
        computed = np.asarray(batch.num_computed, dtype=np.int64)
        self._turn ^= 1
        h = self._staging[self._turn]
        ids, seq, slot, state, table = h.n_ids, h.n_seq, h.n_slot, h.n_state, h.n_table
        ids[:n] = batch.input_ids
        ids[n:bs] = 0
        seq[:n] = computed + 1
        seq[n:bs] = 1
        if self.dcp is None:
            last_block = np.fromiter((s.block_np[c // bsz] for s, c in zip(states,
                                                                            batch.num_computed)),
                                     dtype=np.int64, count=n)
            slot[:n] = last_block * bsz + computed % bsz
        slot[n:bs] = -1
        state[:n] = [s.state_slot for s in states]
        state[n:bs] = self.pad_slot
        width = 1
        for i, s in enumerate(states):
            nb = len(s.block_ids)
            table[i, :nb] = s.block_np[:nb]
            width = max(width, nb)
        table[n:bs, 0] = 0
        if self.dcp is not None:   # this rank's slot of each new token (-1: another rank's)
            slot[:n] = dcp_slot_mapping(table[:n], np.arange(n), computed, bsz, self.dcp)
            h.n_local[:n] = self.dcp.local_len(computed + 1)
            h.n_local[n:bs] = 1
        return bs, width

    def load(self, batch: "StepBatch", states: list["CachedRequestState"]) -> int:
        """Copy one step's inputs into the graph buffers (stream order, no host wait); returns
        the capture size to replay. Placeholder input ids (async scheduling) are patched by
        the caller before the replay."""
        bs, width = self.fill_host_inputs(batch, states)
        h = self._staging[self._turn]
        self.input_ids[:bs].copy_(h.ids[:bs], non_blocking=True)
        self.seq_lens[:bs].copy_(h.seq[:bs], non_blocking=True)
        if self.dcp is not None:
            self.local_seq_lens[:bs].copy_(h.local[:bs], non_blocking=True)
        self.slot_mapping[:bs].copy_(h.slot[:bs], non_blocking=True)
        self.state_indices[:bs].copy_(h.state[:bs], non_blocking=True)
        self.block_table[:bs, :width].copy_(h.table[:bs, :width], non_blocking=True)
        return bs

    def replay(self, bs: int, batch: "StepBatch") -> tuple[torch.Tensor, torch.Tensor | None]:
        """(The hidden states of the batch's sampling rows (a view when every row samples),
        the drafter's hidden rows of every batch row [n, W], a view of the graph's output
        buffer that the next replay rewrites; None without hidden_outputs)."""
        out = self.graphs.replay(self.descriptor(bs))
        hidden, aux = out if isinstance(out, tuple) else (out, None)
        n = len(batch.req_ids)
        aux = aux[:n] if aux is not None else None
        if len(batch.sample_rows) == n:            # every decode row samples: a view, no copy
            return hidden[:n], aux
        return hidden[torch.tensor(batch.sample_rows, dtype=torch.long,
                                   device=hidden.device)], aux
