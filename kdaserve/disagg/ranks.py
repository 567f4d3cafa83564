"""What the ranks' connector workers finished, agreed over the ranks (tensor parallelism).

Each rank's connector worker moves its part of a request: the consumer's rank r pulls the
replicated latent KV from the producer's rank 0 and its KDA state shard from the producer's
rank r. A load or a hold is therefore over only when it is over on every rank, and only then may
the scheduler schedule the loaded request or free the held one (a rank still writing into a
block must not see it reused). Each rank keeps what its connector reported until the ranks
agree: at the collects where the scheduler marked transfers outstanding, the ranks all-gather
their pending ids over the world group and each takes the same decision: a load has ended where
it ended on every rank (failed if it failed on any), a hold is done where every rank is done
with it. Bytes add up over the ranks; the latencies are rank 0's.
"""

from __future__ import annotations

from kdaserve.core.sched_output import KVConnectorOutput
from kdaserve.distributed.comm import GroupComm


class RankAgreement:
    def __init__(self, world: GroupComm) -> None:
        self.world = world
        self._sending: set[str] = set()
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        self._bytes = 0
        self._seconds = 0.0

    def add(self, out: KVConnectorOutput) -> None:
        """This rank's connector's report of a step."""
        self._sending |= out.finished_sending
        self._recving |= out.finished_recving
        self._failed |= out.failed_recving
        self._bytes += out.num_bytes_recved
        self._seconds += out.recv_seconds

    def agree(self) -> KVConnectorOutput:
        """What every rank finished (a collective: every rank calls it at the same point)."""
        mine = (set(self._sending), set(self._recving), set(self._failed), self._bytes,
                self._seconds)
        ranks = self.world.all_gather_object(mine)
        self._bytes, self._seconds = 0, 0.0
        sending = set.intersection(*(r[0] for r in ranks))
        ended = set.intersection(*(r[1] | r[2] for r in ranks))
        failed = {rid for rid in ended if any(rid in r[2] for r in ranks)}
        self._sending = self._sending - sending
        self._recving = self._recving - ended
        self._failed = self._failed - ended
        return KVConnectorOutput(finished_sending=sending, finished_recving=ended - failed,
                                 failed_recving=failed,
                                 num_bytes_recved=sum(r[3] for r in ranks),
                                 recv_seconds=ranks[0][4])
