"""CUDA graphs of the draft model's one-token steps (drafts 2..K of every propose call).

Drafts 2..K are K - 1 decode steps of the same requests over the same block tables and scratch
KDA slots; only the token ids (the previous draft, already on the device), the sequence lengths
and the KV slots change. One graph per capture size covers forward + lm_head; a step then costs
three small copies, one replay and the sampler, with no host sync for the token ids. Padding
rows (up to the capture size) compute on the draft's scratch KDA slot, write no KV
(slot_mapping -1) and read one cached token of block 0.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from kdaserve.attention.builder import StepBuffers, slot_mapping
from kdaserve.attention.forward_context import (BatchDescriptor, ExecMode, ForwardContext,
                                                StepPlan, capture_sizes)
from kdaserve.attention.metadata import AttentionMetadata, ModelCaches

if TYPE_CHECKING:
    from kdaserve.worker.cuda_graphs import CudaGraphManager

logger = logging.getLogger(__name__)


def step_inputs(num_computed: np.ndarray, block_table: np.ndarray, block_size: int,
                step: int) -> tuple[np.ndarray, np.ndarray]:
    """(seq_lens, slot_mapping) of draft step `step` (1-based: the token at position
    num_computed + step - 1 is fed) for rows with committed lengths num_computed [n] and block
    tables [n, W]."""
    pos = num_computed.astype(np.int64) + step - 1                       # [n]
    slots = slot_mapping(block_table, np.arange(len(pos)), pos, block_size)
    return (pos + 1).astype(np.int32), slots


class DraftDecodeGraphs(StepBuffers):
    def __init__(self, model: nn.Module, caches: ModelCaches, scratch_slot: int,
                 block_size: int, max_blocks: int, max_num_seqs: int, max_seq_len: int,
                 device: torch.device) -> None:
        self.model, self.caches = model, caches
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size, self.scratch_slot = block_size, scratch_slot
        super().__init__(self.sizes[-1], 1, max_blocks, scratch_slot, max_seq_len, device)
        self.manager: "CudaGraphManager | None" = None
        """The manager holding the graphs, once capture() ran."""
        self._size = 0
        self._n = 0

    def _metadata(self, bs: int) -> AttentionMetadata:
        return self.decode_metadata(bs)

    @staticmethod
    def descriptor(bs: int) -> BatchDescriptor:
        return BatchDescriptor(ExecMode.DRAFT_GRAPH, bs)

    def context(self, bs: int) -> ForwardContext:
        """The forward context of a step of bs rows (the draft model runs the baseline
        backends: no PDL)."""
        return ForwardContext(self._metadata(bs), self.caches,
                              StepPlan.graph(self.descriptor(bs), pdl=False))

    @torch.inference_mode()
    def capture(self, graphs: "CudaGraphManager") -> None:
        t0 = time.perf_counter()
        for bs in reversed(self.sizes):
            ctx = self.context(bs)
            ids = self.input_ids[:bs]
            graphs.capture(self.descriptor(bs),
                           lambda: self.model.compute_logits(self.model(ids, ctx)))
        self.manager = graphs
        torch.cuda.synchronize()
        logger.info("captured %d draft-model CUDA graphs (sizes %s) in %.1f s", len(self.sizes),
                    self.sizes, time.perf_counter() - t0)

    def load(self, block_table: np.ndarray, state_slots: list[int]) -> None:
        """Rows of this propose call: block tables [n, W] and scratch state slots; padding rows
        up to the capture size get the scratch slot, block 0 and no KV write."""
        n, width = block_table.shape
        if n > self.max_bs:
            raise ValueError(f"{n} rows exceed the largest draft graph ({self.max_bs})")
        size = next(s for s in self.sizes if s >= n)
        table = np.zeros((size, max(width, 1)), dtype=np.int32)
        table[:n, :width] = block_table
        state = np.full(size, self.scratch_slot, dtype=np.int32)
        state[:n] = state_slots
        # non_blocking: the host stages the pageable arrays and goes on queueing the draft
        # steps instead of waiting here for the catch-up
        self.block_table[:size, :table.shape[1]].copy_(torch.from_numpy(table),
                                                       non_blocking=True)
        self.state_indices[:size].copy_(torch.from_numpy(state), non_blocking=True)
        self.seq_lens[n:size] = 1
        self.slot_mapping[n:size] = -1
        self._size, self._n = size, n

    def step(self, ids: torch.Tensor, seq_lens: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        """One draft step for the loaded rows: ids [n] (device), seq_lens / slots [n] (host).
        Returns fp32 logits [n, V] (a view of the graph's output: use before the next step)."""
        n = self._n
        self.input_ids[:n].copy_(ids, non_blocking=True)
        self.seq_lens[:n].copy_(torch.from_numpy(seq_lens), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(slots), non_blocking=True)
        return self._run(self._size)[:n]

    def step_device(self, ids: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor
                    ) -> torch.Tensor:
        """step() with seq_lens / slots [n] already on the device (async scheduling)."""
        n = self._n
        self.input_ids[:n].copy_(ids, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.slot_mapping[:n].copy_(slots, non_blocking=True)
        return self._run(self._size)[:n]

    def _run(self, size: int) -> torch.Tensor:
        """Replay the graph of `size` over the buffers; its logits [size, V]."""
        return self.manager.replay(self.descriptor(size))
