"""CUDA graphs for the rejection sampling of uniform verification steps.

Between a verification graph's forward and its commit, sampling ran eagerly: the LM head, the
rejection sampler (bans, temperature, the top-p threshold search, the draws, the accepted
prefix and the output rows) are some fifty small launches. At a few requests a step their host
launch cost exceeds the device time they take, and under async scheduling that host time is on
the step's critical path. Here the whole section is one graph per (capture size, sampling key),
replayed right after the verification forward: it reads the forward's hidden rows and drafts
from the verification graph's buffers, writes each row's emitted count into the commit graph's
input, and leaves the rejection sampler's output in static tensors.

The graph freezes the host branches of the sampler, so each captured key is one common shape of
a batch's sampling parameters (`SampleKey`); a step whose parameters fall outside the captured
keys (top-k, min-p, seeds, logprobs, penalties, min_tokens bans, a grammar) samples eagerly as
before. Per-row values (temperature, top-p) come from two pinned
staging copies a step. Random draws come from the default generator, which CUDA graphs advance
at each replay (as the eager draws do).

Only small batches get these graphs (`MAX_REQS`): the section's launch cost is fixed while its
device time grows with the rows, so from some batch size on the step is device-bound and the
graphs would only hold memory ([rows, vocab] fp32 intermediates in the graph pool).
"""

from __future__ import annotations

import enum
import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from kdaserve.attention.forward_context import BatchDescriptor, ExecMode
from kdaserve.sample.metadata import SamplingMetadata, row_values
from kdaserve.spec_decode.rejection_sampler import (RejectionSampler, RejectionSamplerOutput,
                                                    SpecDecodeMetadata)

if TYPE_CHECKING:
    from kdaserve.spec_decode.verify_graphs import SpecVerifyGraphs
    from kdaserve.worker.cuda_graphs import CudaGraphManager

logger = logging.getLogger(__name__)

MAX_REQS = 8
"""Largest capture size (requests) with sampling graphs."""

_PAD_ROW = np.array([[1.0], [1.0], [0.0], [0.0]], dtype=np.float32)
"""A padding row's (temperature, top-p, min-p, real): a neutral random row that commits nothing."""


class SampleKey(enum.Enum):
    """The sampling shapes captured: every row greedy; every row random without filters (the
    OpenAI API's defaults); every row random with top-p only (the usual chat setting, W1); and
    greedy and random rows together, without filters or with top-p."""
    GREEDY = "greedy"
    RANDOM = "random"
    TOP_P = "top_p"
    MIXED = "mixed"
    MIXED_TOP_P = "mixed_top_p"

    @staticmethod
    def of(md: SamplingMetadata) -> "SampleKey | None":
        """The key a step's metadata samples under, or None (sample eagerly). Per-step
        inputs that a graph cannot take (seeds, logprobs, penalties, bans) give None too."""
        if (md.generators or md.max_num_logprobs is not None or md.processing is not None
                or md.banned_token_ids is not None):
            return None
        if md.all_greedy:
            return SampleKey.GREEDY
        if not md.no_top_k or not md.no_min_p:
            return None
        if md.all_random:
            return SampleKey.RANDOM if md.no_top_p else SampleKey.TOP_P
        return SampleKey.MIXED if md.no_top_p else SampleKey.MIXED_TOP_P

    def metadata(self, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                 min_p: torch.Tensor) -> SamplingMetadata:
        """The frozen metadata a graph of this key is captured with, over static rows."""
        return SamplingMetadata(temperature, top_p, top_k, min_p,
                                all_greedy=self is SampleKey.GREEDY,
                                all_random=self in (SampleKey.RANDOM, SampleKey.TOP_P),
                                no_top_p=self not in (SampleKey.TOP_P, SampleKey.MIXED_TOP_P))


class SpecSampleGraphs:
    """Per capture size bs <= MAX_REQS of the verification graphs and per SampleKey: the LM head
    and the rejection sampler over the bs * (1 + K) window rows, then the emitted counts
    (accepted + 1; 0 on padding rows) into the commit graph's num_accepted."""

    def __init__(self, graphs: "CudaGraphManager", vg: "SpecVerifyGraphs",
                 model: torch.nn.Module, sampler: RejectionSampler, k: int, vocab: int,
                 draft_probs: bool, device: torch.device) -> None:
        """draft_probs: the rejection sampler reads q (standard acceptance of probabilistic
        drafts): a static [max_bs * K, V] fp32 buffer the caller's rows are copied into."""
        self.graphs, self.vg, self.model, self.sampler = graphs, vg, model, sampler
        self.k, self.k1, self.device = k, k + 1, device
        self.sizes = [s for s in vg.sizes if s <= MAX_REQS]
        max_bs = self.max_bs = self.sizes[-1] if self.sizes else 0
        # per-row values: temperature, top-p, min-p, real row (1) or padding (0); top-k
        self.floats = torch.zeros(4, max(max_bs, 1), dtype=torch.float32, device=device)
        self.top_k = torch.zeros(max(max_bs, 1), dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._staging = [(torch.zeros(4, max(max_bs, 1), dtype=torch.float32, pin_memory=pin),
                          torch.zeros(max(max_bs, 1), dtype=torch.int32, pin_memory=pin))
                         for _ in range(2)]
        self._turn = 0
        self.q = (torch.zeros(max_bs * k, vocab, dtype=torch.float32, device=device)
                  if draft_probs and max_bs else None)
        # window token j >= 1 of request i (its draft j - 1) in the verification buffers
        self.draft_pos = (torch.arange(max_bs, device=device)[:, None] * self.k1
                          + torch.arange(1, self.k1, device=device)).reshape(-1)
        self.spec_md = {bs: SpecDecodeMetadata.make([[0] * k] * bs, device) for bs in self.sizes}
        self.num_replays = 0

    def descriptor(self, bs: int, key: SampleKey) -> BatchDescriptor:
        return BatchDescriptor(ExecMode.VERIFY_GRAPH, bs, self.k1, f"sample:{key.value}")

    def _work(self, bs: int, key: SampleKey) -> RejectionSamplerOutput:
        """The captured section at size bs: every window row of the forward's output."""
        t, f = bs * self.k1, self.floats
        hidden = self.vg.hidden_output(bs)[:t]                                  # [t, D]
        logits = self.model.compute_logits(hidden)                              # [t, V]
        spec = self.spec_md[bs]
        spec.draft_token_ids = self.vg.input_ids.index_select(0, self.draft_pos[:bs * self.k])
        md = key.metadata(f[0, :bs], f[1, :bs], self.top_k[:bs], f[2, :bs])
        q = self.q[:bs * self.k] if self.q is not None else None
        out = self.sampler(logits, spec, md, q)
        real = f[3, :bs].to(torch.int64)                                        # [bs]
        self.vg.num_accepted[:bs].copy_((out.num_accepted + 1) * real)
        per_pos = ((out.num_accepted[:, None] > torch.arange(self.k, device=self.device))
                   .to(torch.int64) * real[:, None]).sum(dim=0)                  # [K]
        return RejectionSamplerOutput(out.output_token_ids, out.num_accepted, per_pos)

    @torch.inference_mode()
    def capture(self) -> None:
        """After the verification graphs: every size x key, so that no capture happens while
        serving (a capture synchronises the device and empties the allocator's cache)."""
        t0 = time.perf_counter()
        self.floats.copy_(torch.from_numpy(_PAD_ROW).expand_as(self.floats))
        for bs in reversed(self.sizes):
            for key in SampleKey:
                self.graphs.capture(self.descriptor(bs, key),
                                    lambda bs=bs, key=key: self._work(bs, key))
        if self.sizes:
            torch.cuda.synchronize()
            logger.info("captured %d spec-sampling CUDA graphs (sizes %s, keys %s) in %.1f s",
                        len(self.sizes) * len(SampleKey), self.sizes,
                        [k.value for k in SampleKey], time.perf_counter() - t0)

    def key(self, bs: int, md: SamplingMetadata, num_reqs: int, drafts: list[list[int]]
            ) -> SampleKey | None:
        """The graph key for a step replayed at size bs whose sampling rows are its num_reqs
        requests, each with K drafts (batch order); None: sample eagerly."""
        if bs not in self.spec_md or len(drafts) != num_reqs or md.num_rows != num_reqs:
            return None
        if any(len(d) != self.k for d in drafts):
            return None
        return SampleKey.of(md)

    def run(self, bs: int, key: SampleKey, params: list, q_rows: list[torch.Tensor] | None
            ) -> RejectionSamplerOutput:
        """Stage the rows' values (params: each request's SamplingParams, batch order) and q
        (q_rows: each request's [K, V] draft distributions, when the sampler reads q), replay.
        Returns the output sliced to the real rows; views the next replay rewrites."""
        n = len(params)
        self._turn ^= 1
        floats, top_k = self._staging[self._turn]
        fl, tk = floats.numpy(), top_k.numpy()
        temps, top_ps, top_ks, min_ps = row_values(params)
        fl[:, n:bs] = _PAD_ROW
        fl[0, :n], fl[1, :n], fl[2, :n], fl[3, :n] = temps, top_ps, min_ps, 1.0
        tk[:n], tk[n:bs] = top_ks, 0
        self.floats.copy_(floats, non_blocking=True)     # whole buffers: contiguous, tiny
        self.top_k.copy_(top_k, non_blocking=True)
        if self.q is not None:
            torch.cat(q_rows, out=self.q[:n * self.k])
        out = self.graphs.replay(self.descriptor(bs, key))
        self.num_replays += 1
        return RejectionSamplerOutput(out.output_token_ids[:n], out.num_accepted[:n],
                                      out.accepted_per_position)
