"""The worker's side of hybrid prefix caching: checkpoint rows, and one step's exports.

Cache rows. The KDA cache tensors (ModelCaches.kda_recurrent / kda_conv) hold
`num_state_slots + num_checkpoint_slots + 1` rows: request slots [0, S), checkpoint slots
[S, S + C) (the scheduler's checkpoint slot ids), and the CUDA-graph scratch row S + C last.
A checkpoint costs exactly one request slot's memory (state_bytes_per_slot): on Kimi-Linear-48B
about 40 MiB, five times the MLA KV of 1024 tokens, so the slots are sized and reported apart.

One step. SchedulerOutput.kda_checkpoint_exports names (req_id, num_tokens, dst_slot). For the
batch row of req_id, offset = num_tokens - num_computed: 0 < offset < query_len is an internal
export (AttentionMetadata.kda_checkpoints, written by the KDA layers inside the forward);
offset == query_len is the row's final state, copied slot -> dst after the forward (`post_copies`;
this also covers decode rows and CUDA-graph steps, whose kernels are untouched).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kdaserve.attention.metadata import KDACheckpointRequest, ModelCaches
from kdaserve.config import CacheConfig
from kdaserve.core.prefix_cache import resolve_num_checkpoint_slots
from kdaserve.core.sched_output import SchedulerOutput

GPU_BUDGET_FRACTION = 0.1
"""Default share of the CUDA cache budget given to checkpoint slots."""


def num_checkpoint_slots(cache_config: CacheConfig, budget_bytes: float | None,
                         slot_bytes: int, max_num_seqs: int) -> int:
    """Checkpoint slots: the explicit count, 0 without prefix caching, else on the CPU
    (budget None) the core default, on CUDA 10% of the budget capped at max(64, 2*max_num_seqs)."""
    if budget_bytes is None or not cache_config.enable_prefix_caching or \
            cache_config.num_kda_checkpoint_slots is not None:
        return resolve_num_checkpoint_slots(cache_config)
    by_memory = int(max(budget_bytes, 0) * GPU_BUDGET_FRACTION // slot_bytes)
    return max(1, min(by_memory, max(64, 2 * max_num_seqs)))


def capacity_line(num_state_slots: int, num_ckpt_slots: int, slot_bytes: int) -> str:
    return (f"KDA state slots: {num_state_slots} ({num_state_slots * slot_bytes / 2**30:.2f} "
            f"GiB); KDA checkpoint slots: {num_ckpt_slots} "
            f"({num_ckpt_slots * slot_bytes / 2**30:.2f} GiB)")


@dataclass
class StepExports:
    internal: KDACheckpointRequest | None = None
    post_copies: list[tuple[int, int]] = field(default_factory=list)
    """(request slot, checkpoint slot): copy after the forward."""


def plan_step_exports(so: SchedulerOutput, req_ids: list[str], num_computed: list[int],
                      query_lens: list[int], state_slots: list[int],
                      first_ckpt_slot: int, num_ckpt_slots: int) -> StepExports:
    """Split the step's exports by batch row (rows in the forward's order)."""
    step = StepExports()
    if not so.kda_checkpoint_exports:
        return step
    row = {rid: i for i, rid in enumerate(req_ids)}
    index, offsets, dsts = [], [], []
    for e in so.kda_checkpoint_exports:
        if e.req_id not in row:
            raise RuntimeError(f"KDA checkpoint export for request {e.req_id!r}, which is not "
                               "in this step's batch")
        if not first_ckpt_slot <= e.dst_slot < first_ckpt_slot + num_ckpt_slots:
            raise RuntimeError(f"KDA checkpoint slot {e.dst_slot} is outside the checkpoint "
                               f"rows [{first_ckpt_slot}, {first_ckpt_slot + num_ckpt_slots})")
        i = row[e.req_id]
        offset = e.num_tokens - num_computed[i]
        if not 0 < offset <= query_lens[i]:
            raise RuntimeError(f"KDA checkpoint at {e.num_tokens} tokens is outside request "
                               f"{e.req_id!r}'s chunk ({num_computed[i]}, "
                               f"{num_computed[i] + query_lens[i]}]")
        if offset == query_lens[i]:
            step.post_copies.append((state_slots[i], e.dst_slot))
        else:
            index.append(i)
            offsets.append(offset)
            dsts.append(e.dst_slot)
    if index:
        step.internal = KDACheckpointRequest(req_index=index, offsets=offsets, dst_slots=dsts)
    return step


def apply_post_copies(caches: ModelCaches, step: StepExports) -> None:
    for src, dst in step.post_copies:
        caches.copy_state(src, dst)
