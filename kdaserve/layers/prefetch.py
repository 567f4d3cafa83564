"""Side-stream L2 prefetch of a layer's next weights (KernelConfig.l2_prefetch).

A layer wraps its latency-bound kernels in `with self.prefetch(num_tokens, weight, ...):`; the
weights are read into L2 on a side stream meanwhile, and the main stream waits for that read
before the block ends (so the GEMM after it finds them there). Inside a CUDA-graph capture the
side stream becomes a parallel branch of the graph.
"""

from __future__ import annotations

import contextlib

import torch

MAX_TOKENS = 64
"""Up to this many rows a projection is weight-bandwidth bound: prefetch only then."""


class WeightPrefetch:
    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._stream: torch.cuda.Stream | None = None
        self._sink: torch.Tensor | None = None

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    @contextlib.contextmanager
    def __call__(self, num_tokens: int, *weights: torch.Tensor):
        if not (self.enabled and weights and weights[0].is_cuda and num_tokens <= MAX_TOKENS):
            yield
            return
        from kdaserve.kernels.linear.prefetch import PROGRAMS_PER_SM, prefetch_l2
        from kdaserve.kernels.utils import num_sms

        device = weights[0].device
        main, side = torch.cuda.current_stream(device), self._side_stream(device)
        if self._sink is None:
            self._sink = torch.empty(PROGRAMS_PER_SM * num_sms(device), dtype=torch.int32,
                                     device=device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for w in weights:
                prefetch_l2(w, self._sink)
        try:
            yield
        finally:
            main.wait_stream(side)


NO_PREFETCH = WeightPrefetch()
"""The default of every layer: disabled."""
