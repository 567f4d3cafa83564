"""Start-up warm-up: eager steps over the compositions serving meets, and the sampler's
variants, so that their JIT compilation and autotuning happen before the first request.

Triton specialises kernels on integer values and pointer alignment, and fla autotunes its
l2norm per token-count bucket: each new step composition may compile, and a compile inside a
request's step is a time-to-first-token stall. The warm-up runs on the live caches before any
request holds a block or a slot: what it writes is garbage that a request overwrites before it
reads (new KV rows are stored before attention reads them; a new request's KDA state is not
read, has_initial_state is false).
"""

from __future__ import annotations

import numpy as np
import torch

from kdaserve.attention.builder import build_metadata
from kdaserve.attention.forward_context import ForwardContext
from kdaserve.attention.kda_backend import SHORT_PREFILL_MAX
from kdaserve.attention.metadata import KDACheckpointRequest
from kdaserve.config import SchedulerConfig
from kdaserve.kernels.moe.fused_moe import SMALL_ALIGN_ENTRIES, small_align_tiles
from kdaserve.layers.moe import TopkRouter
from kdaserve.sample.metadata import SamplingMetadata
from kdaserve.sample.sampler import Sampler
from kdaserve.sampling_params import SamplingParams
from kdaserve.worker.model_runner import ModelRunner


@torch.inference_mode()
def warmup_steps(runner: ModelRunner, sc: SchedulerConfig) -> None:
    """Every count of decode rows from 0 to 16 and some beyond (the prefill rows' index arrays
    start after them), each alone (eager decode steps: past the captured graph sizes, or
    enforce_eager) and next to a chunk over a cached prefix and a fresh prefill, one decode row
    at a long context (the MLA split count follows the longest context), short rows that all
    continue a state, fresh prefills across the token budget, and budget-filling chunks next
    to a few decode rows."""
    max_rows = min(sc.max_num_seqs, runner.num_slots) - 2
    long_ctx = min(sc.max_model_len, runner.num_blocks * runner.block_size // 2) - 1
    for d in [d for d in range(max_rows + 3) if d <= 16 or d % 8 == 0 or d >= max_rows]:
        computed = [long_ctx] + [17 + 3 * i for i in range(1, d)] if d else []
        if d <= max_rows:
            exports = [(0, 64), (0, 70), (1, 40)] if d == 0 else None
            _forward(runner, [1] * d + [100, 61], computed + [33, 0], exports)
        if d:                                   # decode only: eager past the graph sizes
            _forward(runner, [1] * d, computed)
    # steps whose every row continues a state within SHORT_PREFILL_MAX tokens (a chunked
    # prefill's short tail next to decodes, a draft catch-up): fla's fused recurrent kernel
    # instead of chunk_kda, a path no step above takes
    for d in (0, 1, 3, 13):
        if d <= max_rows:
            computed = [long_ctx] + [17 + 3 * i for i in range(1, d)] if d else []
            for q in (2, SHORT_PREFILL_MAX):
                _forward(runner, [1] * d + [q], computed + [40])
    budget = min(sc.max_num_batched_tokens, sc.max_model_len)
    for j in range(1, 9):
        _forward(runner, [max(1, budget * j // 8 - 3)], [0])
    # a chunk that fills the token budget next to d decode rows (the common mixed step under
    # load): the step's token count is then a multiple of 16 while the chunk's is not, a
    # specialisation the steps above do not produce
    for d in (1, 2, 3, 16, 17):
        if d <= max_rows and budget > d:
            computed = [long_ctx] + [17 + 3 * i for i in range(1, d)]
            _forward(runner, [1] * d + [budget - d], computed + [0])
    # the MoE alignment kernel's one-program variants follow the step's routing entries (its
    # BLOCK_T bucket) and the GEMM tile class (its block_m): both ends of every bucket
    for t in _alignment_token_counts(runner, budget):
        _forward(runner, [t], [0])
    if runner.device.type == "cuda":
        torch.cuda.synchronize()


def _alignment_token_counts(runner: ModelRunner, budget: int) -> list[int]:
    """The least and the largest token count (<= budget) of every BLOCK_T bucket of
    moe_align_small_kernel, for each routing width of the model's routers (top_k, and
    top_k + 1 where the shared experts ride along as an extra routed expert). The GEMM tile
    class grows with the token count too, so a class boundary inside a bucket has its two
    sides at the bucket's two ends."""
    widths = {w for m in runner.model.modules() if isinstance(m, TopkRouter)
              for w in (m.top_k, m.top_k + 1)}
    counts: set[int] = set()
    for w in widths:
        ends: dict[int, list[int]] = {}
        for t in range(1, min(budget, SMALL_ALIGN_ENTRIES // w) + 1):
            ends.setdefault(small_align_tiles(t * w)[0], []).append(t)
        counts.update(t for ts in ends.values() for t in (ts[0], ts[-1]))
    return sorted(counts)


def _forward(runner: ModelRunner, query_lens: list[int], computed: list[int],
             exports: list[tuple[int, int]] | None = None) -> None:
    """exports: (batch row, offset) checkpoint exports, all into the scratch KDA row (index
    runner.num_slots, garbage by contract)."""
    bs = runner.block_size
    need = [-(-(c + q) // bs) for q, c in zip(query_lens, computed)]
    if sum(need) > runner.num_blocks:
        return
    starts = np.cumsum([0] + need)
    blocks = [list(range(a, b)) for a, b in zip(starts[:-1], starts[1:])]
    md = build_metadata(query_lens, computed, blocks, list(range(len(query_lens))), bs,
                        runner.device, dcp=runner.dcp)   # DCP: its kernels and collectives
    if exports:
        md.kda_checkpoints = KDACheckpointRequest([i for i, _ in exports],
                                                  [o for _, o in exports],
                                                  [runner.num_slots] * len(exports))
    # distinct tokens (the routed experts spread as in real steps)
    ids = torch.arange(sum(query_lens), device=runner.device) * 7919 % runner.args.vocab_size
    h = runner.model(ids, ForwardContext(md, runner.caches))
    runner.model.compute_logits(h[-len(query_lens):])


def warmup_sampler(sampler: Sampler, vocab_size: int, device: torch.device) -> None:
    """Sample once with top-p alone, once with top-p plus top-k on some rows and once with
    neither: the threshold kernels' variants and the race's (with and without a threshold)
    compile at start-up, not in the first requests' steps. Seeded rows, so the global CUDA
    generator is left as it was."""
    logits = torch.randn(2, vocab_size, device=device)
    gens = {i: torch.Generator(device=device).manual_seed(i) for i in range(2)}
    for params in ([SamplingParams(temperature=1.0, top_p=0.9, seed=0)] * 2,
                   [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=0),
                    SamplingParams(temperature=1.0, top_p=0.9, seed=1)],
                   [SamplingParams(temperature=1.0, seed=0)] * 2):
        sampler(logits, SamplingMetadata.build(params, gens, None, device))
    if sampler.race_kernel:   # the drafters' variants: tempered draws, q with one-hot rows
        from kdaserve.kernels.sample.race import race_sample
        from kdaserve.kernels.sample.softmax import tempered_softmax

        temps = torch.tensor([1.0, 0.0], device=device)
        seeds = torch.zeros(2, dtype=torch.int64, device=device)
        ids = race_sample(logits, seeds, None, temps)
        tempered_softmax(logits, temps, ids)
        tempered_softmax(logits)
    torch.cuda.synchronize()
