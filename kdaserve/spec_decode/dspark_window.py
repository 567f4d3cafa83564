"""CUDA graphs of the DSpark drafter's whole proposal after a verification graph: the context
store of the window's verified positions, then the query-block pass and the Markov head.

In the steady state of speculative decoding every request verifies K drafts in a captured
verification graph, and DSparkProposer.propose_device then stores the context latents of the
positions the step verified and drafts from each request's last token. Its block pass and
Markov head already replay a graph (dspark_graphs.py), but the positions, slots and block inputs
around them are some forty eager launches and a handful of host-to-device copies: at a few
requests a step, host time on the step's critical path. For such a step the positions follow
from the verification window itself (request i's tokens are rows i * (1 + K) .. of the
verification graph's aux output, at start[i] + 0..K, the first verified[i] of them final), so
the whole proposal is one graph per capture size, reading the verification graph's static aux
rows and four small inputs: the true starts, the verified counts and the last tokens (device
copies) and the block tables with the temperatures (one pinned staging copy each).

Padding rows (up to the capture size) are masked on the device by a real-row flag: they store
no context, write no latent and attend to nothing, whatever stale values their buffers hold.
Only the small capture sizes get these graphs (sample_graphs.MAX_REQS, for the same reason).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kdaserve.attention.forward_context import BatchDescriptor, ExecMode
from kdaserve.spec_decode.dspark_graphs import block_drafts, capture_each
from kdaserve.spec_decode.sample_graphs import MAX_REQS

if TYPE_CHECKING:
    from kdaserve.spec_decode.device_step import DeviceStep
    from kdaserve.spec_decode.dspark import DSparkProposer
    from kdaserve.spec_decode.verify_graphs import SpecVerifyGraphs
    from kdaserve.worker.cuda_graphs import CudaGraphManager


class DSparkWindowGraphs:
    def __init__(self, proposer: "DSparkProposer", vg: "SpecVerifyGraphs") -> None:
        self.proposer, self.vg = proposer, vg
        self.sizes = [s for s in vg.sizes if s <= MAX_REQS]
        k, dev = proposer.k, proposer.device
        self.k1 = k1 = k + 1
        max_bs = max(self.sizes, default=1)
        width = proposer.max_blocks_per_req
        self.start = torch.zeros(max_bs, dtype=torch.long, device=dev)          # [S]
        self.verified = torch.zeros(max_bs, dtype=torch.long, device=dev)       # [S]
        self.last = torch.zeros(max_bs, dtype=torch.long, device=dev)           # [S]
        self.table = torch.zeros(max_bs, width, dtype=torch.long, device=dev)   # [S, W]
        self.floats = torch.zeros(2, max_bs, dtype=torch.float32, device=dev)   # temps, real
        pin = dev.type == "cuda"
        self._staging = [(torch.zeros(max_bs, width, dtype=torch.long, pin_memory=pin),
                          torch.zeros(2, max_bs, dtype=torch.float32, pin_memory=pin))
                         for _ in range(2)]
        self._turn = 0
        self.tok_row = torch.arange(max_bs, device=dev).repeat_interleave(k1)   # [S * (1+K)]
        self.tok_off = torch.arange(k1, device=dev).repeat(max_bs)              # [S * (1+K)]
        self.block_off = torch.arange(k, device=dev)                            # [K]
        self.manager: "CudaGraphManager | None" = None
        self.num_replays = 0

    def descriptor(self, size: int) -> BatchDescriptor:
        return BatchDescriptor(ExecMode.DRAFT_GRAPH, size, self.k1, "dspark_window")

    @torch.inference_mode()
    def capture(self, graphs: "CudaGraphManager") -> None:
        capture_each(graphs, self.sizes, self.descriptor, self._work, self.proposer.device,
                     "DSpark window")
        self.manager = graphs

    def _work(self, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a replay runs: propose_device's steps 1-3 for `size` verified windows."""
        p = self.proposer
        k, t = p.k, size * self.k1
        kv = list(p.caches.mla_kv)
        start, verified, table = self.start[:size], self.verified[:size], self.table[:size]
        real = self.floats[1, :size] > 0                                          # [S]
        # 1. context latents of each window's verified positions
        row, off = self.tok_row[:t], self.tok_off[:t]
        pos = start.index_select(0, row) + off                                     # [t]
        keep = (off < verified.index_select(0, row)) & real.index_select(0, row)
        slots = p._slots(table.index_select(0, row), pos)
        p.model.store_context(self.vg.aux_output(size)[:t], kv, torch.where(keep, slots, -1))
        # 2. + 3. K query rows per window from its last token, then the Markov head
        pos0 = start + verified                                                    # [S]
        real_b = real.repeat_interleave(k)                                         # [S * K]
        block_pos = (pos0[:, None] + self.block_off).reshape(-1)
        tab = table.repeat_interleave(k, dim=0)                                    # [S * K, W]
        ids = torch.full((size, k), p.model.cfg.mask_token_id, dtype=torch.long,
                         device=pos0.device)
        ids[:, 0] = self.last[:size]
        block_slots = torch.where(real_b, p._slots(tab, block_pos), -1)
        seq_lens = torch.where(real_b, (pos0 + k).repeat_interleave(k), 0).int()
        return block_drafts(p.model, kv, ids.reshape(-1), block_slots, tab.int(), seq_lens,
                            self.last[:size], self.floats[0, :size], p.sample_method, k,
                            p.race_draws)

    def covers(self, step: "DeviceStep", known: dict) -> bool:
        """The step replayed a verification graph of one of the sizes (step.verify_size), every
        batch row is a request the drafter holds (known), verifying K drafts and sampling."""
        n = len(step.req_ids)
        return (step.verify_size in self.sizes and self.manager is not None and step.is_spec is not None
                and step.sample_rows == list(range(n)) and all(step.is_spec)
                and all(q == self.k1 for q in step.query_lens)
                and all(r is not None and r in known for r in step.req_ids))

    def run(self, size: int, block_ids: list[list[int]], step: "DeviceStep"
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One proposal for the step's n windows (block_ids: each request's drafter blocks).
        Returns (drafts [n, K] int64, q [n, K, V] or None), fresh tensors (a request's q may
        be read after the next replay)."""
        n = len(block_ids)
        self._turn ^= 1
        table, floats = self._staging[self._turn]
        tab, fl = table.numpy(), floats.numpy()
        for i, ids in enumerate(block_ids):
            tab[i, :len(ids)] = ids
        fl[0, :n], fl[0, n:size] = step.temperatures, 0.0
        fl[1, :n], fl[1, n:size] = 1.0, 0.0
        self.table.copy_(table, non_blocking=True)
        self.floats.copy_(floats, non_blocking=True)
        self.start[:n].copy_(step.start)
        self.verified[:n].copy_(step.verified)
        self.last[:n].copy_(step.last)
        drafts, q = self.manager.replay(self.descriptor(size))
        self.num_replays += 1
        return drafts[:n].clone(), None if q is None else q[:n].clone()

