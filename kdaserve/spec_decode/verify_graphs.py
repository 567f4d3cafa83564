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
accepted counts are its only input (eagerly it is two Triton launches per KDA layer, whose host
launch cost is comparable to the whole verification forward).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from kdaserve.attention import kda_spec
from kdaserve.attention.builder import StepBuffers, slot_mapping
from kdaserve.attention.forward_context import (BatchDescriptor, ExecMode, ForwardContext,
                                                StepPlan)
from kdaserve.attention.metadata import (AttentionMetadata, MLAAbsorbedRows, ModelCaches,
                                         SpecStep)

if TYPE_CHECKING:
    from kdaserve.worker.cuda_graphs import CudaGraphManager
    from kdaserve.worker.input_batch import CachedRequestState, StepBatch

logger = logging.getLogger(__name__)


class WindowBuffers(StepBuffers):
    """Device buffers of a step of up to max_bs requests with k1 token rows each, and its
    metadata: KDA in the RecoverSSM verify form, MLA one absorbed row per token. Shared by the
    target's verification graphs and the draft model's catch-up windows. Padding requests (up
    to a capture size) use pad_slot and write no KV (slot_mapping -1)."""

    def __init__(self, max_bs: int, k1: int, max_blocks: int, pad_slot: int, max_seq_len: int,
                 device: torch.device) -> None:
        super().__init__(max_bs, k1, max_blocks, pad_slot, max_seq_len, device)
        tok = max_bs * k1
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
                                          self.mla_block_table[:t], rows_per_seq=k1)
        self._md[bs] = md
        return md

    def _token_block_tables(self, bs: int) -> None:
        """Each token row's block table from its request's (inside the captured work)."""
        t = bs * self.k1
        self.mla_block_table[:t] = self.block_table.index_select(0, self.token_req[:t])


class SpecVerifyGraphs(WindowBuffers):
    def __init__(self, graphs: "CudaGraphManager", model: torch.nn.Module, caches: ModelCaches,
                 k: int, pad_slot: int, block_size: int, max_model_len: int,
                 device: torch.device, hidden_outputs: dict | None = None) -> None:
        """hidden_outputs: as DecodeGraphs' (the drafter's hidden rows, a second output)."""
        self.graphs, self.model, self.caches = graphs, model, caches
        self.hidden_outputs = hidden_outputs or {}
        self.block_size = block_size
        self.sizes = graphs.sizes
        super().__init__(self.sizes[-1], k + 1, -(-(max_model_len + k) // block_size),
                         pad_slot, max_model_len, device)
        tok = self.max_bs * self.k1
        # per token: its offset in the window (for the absorbed MLA rows' sequence lengths)
        self.token_off = (torch.arange(tok, device=device) % self.k1).to(torch.int32)
        self.num_accepted = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.steps: dict[int, SpecStep] = {}
        """Per capture size, the SpecStep its graph fills (the commit reads its records)."""
        self._outputs: dict[int, torch.Tensor | tuple] = {}
        """Per capture size, the forward's output as last replayed (a graph's static output)."""
        self.num_replays = 0

    def descriptor(self, bs: int, stage: str = "forward") -> BatchDescriptor:
        return BatchDescriptor(ExecMode.VERIFY_GRAPH, bs, self.k1, stage)

    # ---- capture ----
    def _forward(self, bs: int, md: AttentionMetadata, eager: bool = False) -> torch.Tensor:
        """The captured work: per-token MLA inputs from the per-request buffers, then the
        model over bs * (1 + K) tokens. eager: under the plan of an eager step instead (no
        PDL), as verification rows run next to a prefill chunk."""
        t = bs * self.k1
        self._token_block_tables(bs)
        # token j of a window sees the context before the step plus window tokens 0..j
        self.mla_seq_lens[:t] = self.seq_lens.index_select(0, self.token_req[:t]) \
            - (self.k1 - 1) + self.token_off[:t]
        md.spec.records.clear()
        md.spec.conv_inputs.clear()
        plan = StepPlan.eager(md) if eager else self.graphs.plan(self.descriptor(bs))
        ctx = ForwardContext(md, self.caches, plan)
        return self.model(self.input_ids[:t], ctx, **self.hidden_outputs)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        # Verification rows next to a prefill chunk run eagerly, where the kernels launch
        # without PDL: a constexpr of their own, so variants the graphs do not build. Build
        # them first (the captures below then leave each size's records as their graphs
        # hold them). The window kernels' other keys do not follow the batch; the largest
        # size covers the split rule's other end.
        self._eager_forwards()
        for bs in reversed(self.sizes):
            md = self._metadata(bs)
            self._outputs[bs] = self.graphs.capture(self.descriptor(bs),
                                                    lambda bs=bs, md=md: self._forward(bs, md))
            self.steps[bs] = md.spec
            # the buffers hold padding rows here: the warm-up commits zero tokens to scratch
            self.graphs.capture(self.descriptor(bs, "commit"),
                                lambda bs=bs, md=md: self._commit_work(bs, md.spec), warmups=1)
        torch.cuda.synchronize()
        logger.info("captured %d spec-verify CUDA graphs (sizes %s, %d tokens per request) in "
                    "%.1f s", len(self.sizes), self.sizes, self.k1, time.perf_counter() - t0)

    @torch.inference_mode()
    def run_uncaptured(self) -> None:
        """capture()'s forwards, eagerly, without capturing them or their commits (the kernel
        variants they launch, compiled ahead: worker.py)."""
        self._eager_forwards()
        for bs in reversed(self.sizes):
            self._forward(bs, self._metadata(bs))

    def _eager_forwards(self) -> None:
        for bs in sorted({self.sizes[0], self.sizes[-1]}):
            self._forward(bs, self._metadata(bs), eager=True)

    # ---- replay ----
    def can_run(self, batch: "StepBatch") -> bool:
        n = len(batch.req_ids)
        return (0 < n <= self.max_bs and all(len(d) == self.k1 - 1 for d in batch.drafts)
                and all(c > 0 for c in batch.num_computed))

    def fill(self, batch: "StepBatch", states: list["CachedRequestState"]) -> int:
        """Write the step into the buffers; returns the capture size."""
        n = len(batch.req_ids)
        bs = next(s for s in self.sizes if s >= n)
        k1, bsz, t = self.k1, self.block_size, n * self.k1
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
        state = np.full(bs, self.pad_slot, dtype=np.int32)
        state[:n] = [s.state_slot for s in states]
        # non_blocking: the host stages the pageable arrays instead of waiting for the device
        # to finish the previous step (async scheduling launches this one before then)
        for buf, val in ((self.input_ids, ids), (self.slot_mapping, slots),
                         (self.seq_lens, seq), (self.state_indices, state)):
            buf[:val.shape[0]].copy_(torch.from_numpy(val), non_blocking=True)
        self.block_table[:bs, :width].copy_(torch.from_numpy(table), non_blocking=True)
        return bs

    def run(self, batch: "StepBatch", states: list["CachedRequestState"], patch=None
            ) -> tuple[torch.Tensor, torch.Tensor | None, SpecStep, int]:
        """Replay the step: (hidden states of every window token [n * (1 + K), D], the
        drafter's hidden rows of them [n * (1 + K), W] (None without hidden_outputs; a view
        the next replay rewrites), the SpecStep the commit reads, the capture size
        replayed). patch(self): called after fill (inputs written on the device from the
        previous step's results, async scheduling)."""
        bs = self.fill(batch, states)
        if patch is not None:
            patch(self)
        out, step = self._run(bs)
        self._outputs[bs] = out
        hidden, aux = out if isinstance(out, tuple) else (out, None)
        self.num_replays += 1
        t = len(batch.req_ids) * self.k1
        return hidden[:t], (aux[:t] if aux is not None else None), step, bs

    def hidden_output(self, bs: int) -> torch.Tensor:
        """The hidden states [bs * (1 + K), D] of the size-bs forward's last replay: for a
        captured graph, its static output (what a graph captured after it reads)."""
        out = self._outputs[bs]
        return out[0] if isinstance(out, tuple) else out

    def _commit_work(self, bs: int, step: SpecStep) -> None:
        """The captured commit: the first num_accepted[i] window tokens into row i's slot."""
        kda_spec.commit(step, self.caches.kda_recurrent, self.caches.kda_conv,
                        self.num_accepted[:bs])

    def commit(self, bs: int, step: SpecStep, num_accepted: list[int] | torch.Tensor) -> None:
        """After sampling the step replayed at size bs: num_accepted per real row (padding
        rows commit zero): a host list or an int64 device tensor."""
        if torch.is_tensor(num_accepted):
            self.num_accepted[:bs].zero_()
            self.num_accepted[:num_accepted.shape[0]].copy_(num_accepted)
        else:
            n = np.zeros(bs, dtype=np.int64)
            n[:len(num_accepted)] = num_accepted
            self.num_accepted[:bs].copy_(torch.from_numpy(n), non_blocking=True)
        self._replay_commit(bs, step)

    def aux_output(self, bs: int) -> torch.Tensor:
        """As hidden_output, the drafter's hidden rows [bs * (1 + K), W] (hidden_outputs)."""
        return self._outputs[bs][1]

    def commit_written(self, bs: int, step: SpecStep) -> None:
        """As commit, where the emitted counts are already in num_accepted (written on the
        device by the sampling graph, padding rows 0)."""
        self._replay_commit(bs, step)

    def _replay_commit(self, bs: int, step: SpecStep) -> None:
        self.graphs.replay(self.descriptor(bs, "commit"))

    def _run(self, bs: int) -> tuple[torch.Tensor, SpecStep]:
        return self.graphs.replay(self.descriptor(bs)), self.steps[bs]
