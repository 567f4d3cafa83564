"""CUDA graphs of the DSpark drafter's query-block pass and Markov head (steps 2 and 3 of
DSparkProposer.propose_device), one per capture size of sampling rows.

The block pass has fixed shapes already (K rows per sampling row), so a step costs a few
device-to-device copies into the graph's inputs and one replay, where eagerly it is some
hundred launches from the host: the dense MLA + MLP layers over S * K rows, the LM head, and K
rounds of Markov bias + sampling. Inputs are device tensors (async scheduling: nothing is read
on the host). Padding rows (up to the capture size) write no latent (slot -1), attend to
nothing (seq_len 0) and are dropped; their draws use temperature 0.

The block tables are copied into a table as wide as the drafter's longest request
(max_blocks_per_req): the MLA decode kernel's split count follows that width, so it is one
grid for every replay. The outputs are cloned before they are returned: a request's draft
probabilities may be read after the next replay (a request not scheduled in the next step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kdaserve.attention.forward_context import BatchDescriptor, ExecMode, capture_sizes
from kdaserve.spec_decode.draft_model import draft_probs, draw_drafts

if TYPE_CHECKING:
    from kdaserve.models.dspark import DSparkModel
    from kdaserve.spec_decode.dspark import DSparkProposer
    from kdaserve.worker.cuda_graphs import CudaGraphManager

logger = logging.getLogger(__name__)


def block_drafts(model: "DSparkModel", kv: list[torch.Tensor], ids: torch.Tensor,
                 slots: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor,
                 last: torch.Tensor, temps: torch.Tensor, sample_method: str, k: int,
                 race: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The query blocks of n requests through the drafter, then its Markov head left to
    right: ids, slots, seq_lens [n * K], table [n * K, W], last [n] (each request's last
    committed token, the Markov head's first `prev`), temps [n]. Returns (drafts [n, K] int64,
    q [n, K, V] fp32 or None for greedy drafts). Eager, or what a graph replay runs. race:
    the draws and q through kernels/sample's fused race and split softmax (draw_drafts)."""
    n = last.shape[0]
    hidden = model.forward_block(ids, kv, slots, table, seq_lens, k)              # [n * K, D]
    logits = model.base_logits(hidden).view(n, k, -1)                            # [n, K, V]
    if race and logits.is_cuda:   # each position's bias, update and draw in one pass
        drafts = _markov_race_drafts(model, logits, last, temps, sample_method, k)
    else:
        prev, drafts = last, []
        for j in range(k):
            _, bias = model.markov_bias(prev)
            logits[:, j] += bias            # in place: logits ends as every position's own
            prev = draw_drafts(logits[:, j], temps, sample_method)
            drafts.append(prev)
        drafts = torch.stack(drafts, dim=1)                                      # [n, K]
    if sample_method == "greedy":
        return drafts, None
    # q of all K positions in one softmax (one launch over n * K rows, not K launches)
    q = draft_probs(logits.view(n * k, -1), temps.repeat_interleave(k), drafts.view(-1), race)
    return drafts, q.view(n, k, -1)


def _markov_race_drafts(model: "DSparkModel", logits: torch.Tensor, last: torch.Tensor,
                        temps: torch.Tensor, sample_method: str, k: int) -> torch.Tensor:
    """block_drafts' Markov head through kernels/sample/race.py markov_race: per position one
    pass adds the bias of the previous draw to its logits (in place) and draws (temperature 0:
    the argmax, as greedy drafts). Returns drafts [n, K] int64."""
    from kdaserve.kernels.sample.race import markov_race

    n = last.shape[0]
    ids = torch.empty(k, n, dtype=torch.int64, device=logits.device)             # [K, n]
    if sample_method == "greedy":
        temps = torch.zeros(n, dtype=torch.float32, device=logits.device)
        seeds = torch.zeros(k, n, dtype=torch.int64, device=logits.device)
    else:
        temps = temps.float()
        seeds = torch.empty(k, n, dtype=torch.int64, device=logits.device).random_(0, 2**62)
    emb, proj = model.markov_embed.weight, model.markov_proj.weight                # [V, r]
    prev = last
    for j in range(k):
        markov_race(logits[:, j], emb, proj, prev, seeds[j], temps, out=ids[j])
        prev = ids[j]
    return ids.t().contiguous()


def capture_each(graphs: "CudaGraphManager", sizes: list[int],
                 descriptor: Callable[[int], BatchDescriptor], work: Callable[[int], Any],
                 device: torch.device, what: str) -> None:
    """Capture work(size) at every size, largest first, into `graphs`, and log it."""
    t0 = time.perf_counter()
    for size in reversed(sizes):
        graphs.capture(descriptor(size), lambda size=size: work(size))
    if device.type == "cuda":
        torch.cuda.synchronize()
    logger.info("captured %d %s CUDA graphs (sizes %s) in %.1f s", len(sizes), what, sizes,
                time.perf_counter() - t0)


class DSparkBlockGraphs:
    def __init__(self, proposer: "DSparkProposer", max_num_seqs: int) -> None:
        self.proposer = proposer
        self.sizes = capture_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        k, dev = proposer.k, proposer.device
        rows = self.max_size * k
        self.ids = torch.zeros(rows, dtype=torch.long, device=dev)               # [S * K]
        self.slots = torch.full((rows,), -1, dtype=torch.long, device=dev)       # [S * K]
        self.table = torch.zeros(rows, proposer.max_blocks_per_req, dtype=torch.int32,
                                 device=dev)                                      # [S * K, W]
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=dev)         # [S * K]
        self.last = torch.zeros(self.max_size, dtype=torch.long, device=dev)     # [S]
        self.temps = torch.zeros(self.max_size, dtype=torch.float32, device=dev)  # [S]
        self.manager: "CudaGraphManager | None" = None

    def descriptor(self, size: int) -> BatchDescriptor:
        return BatchDescriptor(ExecMode.DRAFT_GRAPH, size, self.proposer.k, "dspark_block")

    def padded_size(self, s: int) -> int | None:
        return next((size for size in self.sizes if size >= s), None)

    @torch.inference_mode()
    def capture(self, graphs: "CudaGraphManager") -> None:
        capture_each(graphs, self.sizes, self.descriptor, self._work, self.proposer.device,
                     "DSpark block")
        self.manager = graphs

    @torch.inference_mode()
    def run_block_uncaptured(self) -> None:
        """Every capture size's block pass and base logits, eagerly, without the Markov head
        (its draws index the Markov embedding: garbage while kernels are deferred): the
        kernel variants a capture launches there, compiled ahead (worker.py)."""
        p = self.proposer
        for size in reversed(self.sizes):
            r = size * p.k
            p.model.base_logits(p.model.forward_block(
                self.ids[:r], list(p.caches.mla_kv), self.slots[:r], self.table[:r],
                self.seq_lens[:r], p.k))

    def _work(self, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a replay runs: block_drafts over the first size * K rows of the buffers."""
        p = self.proposer
        r = size * p.k
        return block_drafts(p.model, list(p.caches.mla_kv), self.ids[:r], self.slots[:r],
                            self.table[:r], self.seq_lens[:r], self.last[:size],
                            self.temps[:size], p.sample_method, p.k, p.race_draws)

    def run(self, ids: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
            seq_lens: torch.Tensor, last: torch.Tensor, temps: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One proposal for s sampling rows: ids, slots [s * K] int64, table [s * K, W'] (W' <=
        the buffers' width), seq_lens [s * K] int32, last [s] int64, temps [s] fp32, all on the
        device. Returns (drafts [s, K] int64, q [s, K, V] or None), fresh tensors."""
        s, k = last.shape[0], self.proposer.k
        size = self.padded_size(s)
        if size is None:
            raise ValueError(f"{s} sampling rows exceed the largest DSpark graph "
                             f"({self.max_size})")
        r, pad = s * k, size * k
        width = table.shape[1]
        if width > self.table.shape[1]:
            raise ValueError(f"block tables of {width} blocks exceed the DSpark graphs' "
                             f"{self.table.shape[1]}")
        self.ids[:r].copy_(ids)
        self.slots[:r].copy_(slots)
        self.table[:r, :width].copy_(table)
        self.seq_lens[:r].copy_(seq_lens)
        self.last[:s].copy_(last)
        self.temps[:s].copy_(temps)
        if pad > r:   # padding rows: no latent written, nothing attended, greedy draws
            self.slots[r:pad].fill_(-1)
            self.seq_lens[r:pad].zero_()
            self.temps[s:size].zero_()
        drafts, q = self.manager.replay(self.descriptor(size))
        return drafts[:s].clone(), None if q is None else q[:s].clone()
