"""Under tensor parallelism a transfer is over only when every rank's connector is done with it:
RankAgreement's decision over two in-process ranks (their all-gather meets at a barrier)."""

from __future__ import annotations

import pickle
import threading

from kdaserve.core.sched_output import KVConnectorOutput
from kdaserve.disagg.ranks import RankAgreement
from kdaserve.distributed.comm import GroupComm


class _TwoRanks(GroupComm):
    def __init__(self, shared: dict, rank: int) -> None:
        super().__init__(group=object(), rank=rank, size=2)
        self.shared = shared

    def all_gather_object(self, obj):
        self.shared[self.rank] = pickle.loads(pickle.dumps(obj))   # as gloo sends it
        self.shared["barrier"].wait()
        out = [self.shared[0], self.shared[1]]
        self.shared["barrier"].wait()
        return out


def _agree(ranks, reports):
    for r, rep in zip(ranks, reports):
        r.add(rep)
    outs = [None, None]
    threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, ranks[i].agree()))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert outs[0] == outs[1]
    return outs[0]


def test_a_transfer_ends_when_every_rank_is_done_with_it():
    shared = {"barrier": threading.Barrier(2)}
    ranks = [RankAgreement(_TwoRanks(shared, r)) for r in range(2)]
    out = _agree(ranks, [KVConnectorOutput(finished_recving={"a"}, finished_sending={"h"},
                                           num_bytes_recved=100, recv_seconds=0.5),
                         KVConnectorOutput(failed_recving={"b"}, num_bytes_recved=40)])
    assert out.is_empty and out.num_bytes_recved == 140 and out.recv_seconds == 0.5
    # rank 1 finishes a, rank 0 fails b, rank 1 is done with h: all three end, b failed
    out = _agree(ranks, [KVConnectorOutput(failed_recving={"b"}),
                         KVConnectorOutput(finished_recving={"a"}, finished_sending={"h"})])
    assert (out.finished_recving, out.failed_recving, out.finished_sending) == (
        {"a"}, {"b"}, {"h"})
    out = _agree(ranks, [KVConnectorOutput(), KVConnectorOutput()])
    assert out.is_empty                       # each id is reported once
