"""build_metadata (vectorised) against the definitions of its fields."""

from __future__ import annotations

import random

import numpy as np

from kdaserve.attention.builder import build_metadata


def test_fields_match_their_definitions():
    rng = random.Random(0)
    for _ in range(100):
        n = rng.randint(1, 6)
        q = [rng.randint(1, 40) for _ in range(n)]
        c = [rng.randint(0, 100) for _ in range(n)]
        blocks = [rng.sample(range(1000), (a + b + 15) // 16 + rng.randint(0, 2))
                  for a, b in zip(q, c)]
        as_arrays = rng.random() < 0.5
        md = build_metadata(q, c, [np.asarray(b, np.int32) if as_arrays else b for b in blocks],
                            list(range(n)), 16, "cpu")
        assert md.slot_mapping.tolist() == [blocks[i][p // 16] * 16 + p % 16
                                            for i in range(n) for p in range(c[i], c[i] + q[i])]
        assert md.query_start_loc.tolist() == [0] + list(np.cumsum(q))
        assert md.seq_lens.tolist() == [a + b for a, b in zip(q, c)]
        assert md.num_computed_tokens_cpu.tolist() == c
        assert md.has_initial_state.tolist() == [x > 0 for x in c]
        assert md.max_query_len == max(q) and md.max_seq_len == max(a + b for a, b in zip(q, c))
        for i, b in enumerate(blocks):
            assert md.block_table[i, :len(b)].tolist() == b


def test_dcp_slots_shard_each_context_once():
    """Decode context parallelism: rank r stores the positions p with (p // I) % n == r, in
    position order from local index 0, in the physical block the logical block p // (n * bs)
    names; every position is stored by exactly one rank, and local_seq_lens count them."""
    from kdaserve.attention.dcp import DCPGroup

    rng = random.Random(1)
    bs = 16
    for n, inter in [(2, 1), (2, 16), (3, 2), (4, 4), (2, 8)]:
        for _ in range(20):
            k = rng.randint(1, 5)
            q = [rng.randint(1, 70) for _ in range(k)]
            c = [rng.randint(0, 150) for _ in range(k)]
            blocks = [rng.sample(range(1000), -(-(a + b) // (n * bs)) + rng.randint(0, 1))
                      for a, b in zip(q, c)]
            owners = {}
            for r in range(n):
                md = build_metadata(q, c, blocks, list(range(k)), bs, "cpu",
                                    dcp=DCPGroup(n, r, inter))
                slots = md.slot_mapping.tolist()
                t = 0
                for i in range(k):
                    mine = [p for p in range(c[i] + q[i]) if (p // inter) % n == r]
                    assert md.dcp.local_seq_lens[i] == len(mine)
                    for p in range(c[i], c[i] + q[i]):
                        if (p // inter) % n == r:
                            li = mine.index(p)
                            assert li // bs == p // (n * bs)     # the logical block's entry
                            assert slots[t] == blocks[i][li // bs] * bs + li % bs
                            owners.setdefault((i, p), []).append(r)
                        else:
                            assert slots[t] == -1
                        t += 1
                assert md.seq_lens.tolist() == [a + b for a, b in zip(q, c)]
            assert all(len(v) == 1 for v in owners.values())
            assert len(owners) == sum(q)


def test_dcp_of_size_one_is_plain():
    from kdaserve.attention.dcp import DCPGroup

    md = build_metadata([3, 5], [4, 0], [[7, 2], [1]], [0, 1], 4, "cpu", dcp=DCPGroup(1, 0))
    plain = build_metadata([3, 5], [4, 0], [[7, 2], [1]], [0, 1], 4, "cpu")
    assert md.dcp is None and md.slot_mapping.tolist() == plain.slot_mapping.tolist()


def test_dcp_rank_outside_its_group_is_refused():
    import pytest

    from kdaserve.attention.dcp import DCPGroup

    with pytest.raises(ValueError, match="DCP rank 2 outside a group of size 2"):
        DCPGroup(2, 2)
