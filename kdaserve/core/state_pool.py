"""KDA state-slot pool: a fixed number of slots, one per running request.

A slot indexes the recurrent state ([H, K, V] fp32) and the conv state of every KDA layer. Its
size does not depend on the sequence length, so a request holds exactly one slot from its first
schedule until it finishes or is preempted.
"""

from __future__ import annotations

import heapq


class StateSlotPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_state_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots))  # min-heap: lowest id first
        self._in_use = [False] * num_slots

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def is_free(self, slot: int) -> bool:
        return not self._in_use[self._check(slot)]

    def allocate(self) -> int:
        """Take the lowest free slot. Raises when none is free."""
        if not self._free:
            raise RuntimeError(f"no free KDA state slot (all {self.num_slots} in use)")
        slot = heapq.heappop(self._free)
        self._in_use[slot] = True
        return slot

    def free(self, slot: int) -> None:
        if not self._in_use[self._check(slot)]:
            raise RuntimeError(f"double free of KDA state slot {slot}")
        self._in_use[slot] = False
        heapq.heappush(self._free, slot)

    def _check(self, slot: int) -> int:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"KDA state slot must be in [0, {self.num_slots}), got {slot!r}")
        return slot
