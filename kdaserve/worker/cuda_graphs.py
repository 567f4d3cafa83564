"""CUDA graphs for decode-only steps.

One graph per capture size; a step with B decode requests replays the graph of the smallest size
>= B. Padding rows compute on a scratch KDA slot (the runner's last slot), write no KV
(slot_mapping -1) and read one cached token; their outputs are dropped.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from kdaserve.attention.metadata import AttentionMetadata, ForwardContext

if TYPE_CHECKING:
    from kdaserve.worker.model_runner import CachedRequestState, ModelRunner, StepBatch

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 513, 32))
    return [s for s in sizes if s <= max_num_seqs] or [1]


def capture_graph(work, pool=None, warmups: int = 2):
    """Run `work` eagerly `warmups` times (autotuning and lazy init stay out of the capture),
    capture it in a CUDA graph on `pool`, and replay it once so that the graph's upload
    happens at start-up, not in the first serving step of its size. Returns (graph, what work
    returned in the capture: the graph's output tensors)."""
    for _ in range(warmups):
        work()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = work()
    graph.replay()
    return graph, out


def decode_metadata(buf, bs: int) -> AttentionMetadata:
    """Metadata of a captured decode step of bs one-token rows over graph input buffers (`buf`
    has query_start_loc, seq_lens, slot_mapping, block_table, state_indices, has_initial_state
    and max_seq_len, the MLA split bound that keeps one grid across replays)."""
    return AttentionMetadata(
        num_reqs=bs, num_decodes=bs, num_actual_tokens=bs,
        query_start_loc=buf.query_start_loc[:bs + 1],
        query_start_loc_cpu=torch.arange(bs + 1, dtype=torch.int32),
        seq_lens=buf.seq_lens[:bs], seq_lens_cpu=torch.ones(bs, dtype=torch.int32),
        num_computed_tokens_cpu=torch.zeros(bs, dtype=torch.int32),
        slot_mapping=buf.slot_mapping[:bs], block_table=buf.block_table[:bs],
        state_indices=buf.state_indices[:bs], has_initial_state=buf.has_initial_state[:bs],
        max_query_len=1, max_seq_len=buf.max_seq_len)


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


class DecodeGraphs:
    def __init__(self, runner: "ModelRunner") -> None:
        self.runner = runner
        self.sizes = capture_sizes(runner.config.scheduler_config.max_num_seqs)
        self.max_bs = self.sizes[-1]
        bs, dev = self.max_bs, runner.device
        max_blocks = -(-runner.config.scheduler_config.max_model_len // runner.block_size)
        self.input_ids = torch.zeros(bs, dtype=torch.long, device=dev)
        self.query_start_loc = torch.arange(bs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(bs, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.full((bs,), -1, dtype=torch.int64, device=dev)
        self.block_table = torch.zeros(bs, max_blocks, dtype=torch.int32, device=dev)
        self.state_indices = torch.full((bs,), runner.num_slots, dtype=torch.int32, device=dev)
        self.has_initial_state = torch.ones(bs, dtype=torch.bool, device=dev)
        # Host staging (pinned): one H2D copy per buffer per step. Two sets, used in turn: with
        # async scheduling a step fills its inputs while the previous step's copies may still
        # be queued behind the device work before them.
        self._staging = [_HostStaging(bs, max_blocks) for _ in range(2)]
        self._turn = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.max_seq_len = runner.config.scheduler_config.max_model_len

    def _metadata(self, bs: int) -> AttentionMetadata:
        return decode_metadata(self, bs)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        model, caches = self.runner.model, self.runner.caches
        for bs in reversed(self.sizes):
            ctx = ForwardContext(self._metadata(bs), caches)
            ids = self.input_ids[:bs]
            graph, hidden = capture_graph(lambda: model(ids, ids, ctx), self.pool)
            self.pool = self.pool or graph.pool()
            self.graphs[bs] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (sizes %s) in %.1f s", len(self.graphs),
                    self.sizes, time.perf_counter() - t0)

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
        bsz = self.runner.block_size
        computed = np.asarray(batch.num_computed, dtype=np.int64)
        self._turn ^= 1
        h = self._staging[self._turn]
        ids, seq, slot, state, table = h.n_ids, h.n_seq, h.n_slot, h.n_state, h.n_table
        ids[:n] = batch.input_ids
        ids[n:bs] = 0
        seq[:n] = computed + 1
        seq[n:bs] = 1
        last_block = np.fromiter((s.block_np[c // bsz] for s, c in zip(states, batch.num_computed)),
                                 dtype=np.int64, count=n)
        slot[:n] = last_block * bsz + computed % bsz
        slot[n:bs] = -1
        state[:n] = [s.state_slot for s in states]
        state[n:bs] = self.runner.num_slots
        width = 1
        for i, s in enumerate(states):
            nb = len(s.block_ids)
            table[i, :nb] = s.block_np[:nb]
            width = max(width, nb)
        table[n:bs, 0] = 0
        return bs, width

    def run(self, batch: "StepBatch", states: list["CachedRequestState"]) -> torch.Tensor:
        bs, width = self.fill_host_inputs(batch, states)
        h = self._staging[self._turn]
        self.input_ids[:bs].copy_(h.ids[:bs], non_blocking=True)
        self.runner.patch_pending_inputs(self.input_ids, batch)
        self.seq_lens[:bs].copy_(h.seq[:bs], non_blocking=True)
        self.slot_mapping[:bs].copy_(h.slot[:bs], non_blocking=True)
        self.state_indices[:bs].copy_(h.state[:bs], non_blocking=True)
        self.block_table[:bs, :width].copy_(h.table[:bs, :width], non_blocking=True)
        graph, hidden = self.graphs[bs]
        graph.replay()
        n = len(batch.req_ids)
        if len(batch.sample_rows) == n:            # every decode row samples: a view, no copy
            return hidden[:n]
        return hidden[torch.tensor(batch.sample_rows, dtype=torch.long, device=hidden.device)]
