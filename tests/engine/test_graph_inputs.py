"""Host-side inputs of a decode CUDA-graph replay (numpy path), checked on the CPU."""

from __future__ import annotations

import random
import types

import numpy as np

from kdaserve.sampling_params import SamplingParams
from kdaserve.worker.cuda_graphs import DecodeGraphs
from kdaserve.worker.input_batch import CachedRequestState, StepBatch


def _staging(max_bs: int, max_blocks: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        n_ids=np.full(max_bs, -7, np.int64), n_seq=np.full(max_bs, -7, np.int32),
        n_slot=np.full(max_bs, -7, np.int64), n_state=np.full(max_bs, -7, np.int32),
        n_table=np.full((max_bs, max_blocks), -7, np.int32),
        n_local=np.full(max_bs, -7, np.int32))


def make_graphs(max_bs: int, max_blocks: int, block_size: int, num_slots: int,
                dcp=None) -> DecodeGraphs:
    g = DecodeGraphs.__new__(DecodeGraphs)        # no CUDA buffers: only the host side
    g.block_size, g.pad_slot, g.dcp = block_size, num_slots, dcp
    g.sizes = [1, 2, 4, 8, 16]
    g._staging = [_staging(max_bs, max_blocks) for _ in range(2)]
    g._turn = 0
    return g


def test_fill_host_inputs_matches_the_definition():
    rng = random.Random(0)
    bs_tok, g = 16, make_graphs(16, 64, 16, 40)
    states, computed = [], []
    for i in range(11):
        c = rng.randrange(1, 900)
        blocks = rng.sample(range(5000), (c + 1 + 15) // 16)
        st = CachedRequestState(f"r{i}", [1] * (c + 1), c, SamplingParams(), blocks[:1], i + 3, c)
        st.add_blocks(blocks[1:])                   # grows the numpy mirror past its capacity
        states.append(st)
        computed.append(c)
    batch = StepBatch([s.req_id for s in states], [rng.randrange(100) for _ in states],
                      [1] * len(states), computed, list(range(len(states))))
    size, width = g.fill_host_inputs(batch, states)
    h = g._staging[g._turn]
    assert size == 16 and width == max(len(s.block_ids) for s in states)
    for i, (s, c) in enumerate(zip(states, computed)):
        assert h.n_ids[i] == batch.input_ids[i] and h.n_seq[i] == c + 1
        assert h.n_slot[i] == s.block_ids[c // bs_tok] * bs_tok + c % bs_tok
        assert h.n_state[i] == s.state_slot
        assert list(h.n_table[i, :len(s.block_ids)]) == s.block_ids
    pad = slice(len(states), size)                  # padding rows: scratch slot, no KV write
    assert (h.n_ids[pad] == 0).all() and (h.n_seq[pad] == 1).all()
    assert (h.n_slot[pad] == -1).all() and (h.n_state[pad] == 40).all()
    assert (h.n_table[pad, 0] == 0).all()


def test_consecutive_steps_fill_alternate_staging_buffers():
    """A step's pinned inputs must not be overwritten by the next step's fill while its copies
    may still be queued (async scheduling): two buffer sets, used in turn."""
    g = make_graphs(4, 4, 16, 8)
    st = CachedRequestState("r", [1, 2, 3], 2, SamplingParams(), [0], 0, 2)
    batch = StepBatch(["r"], [7], [1], [2], [0])
    g.fill_host_inputs(batch, [st])
    first = g._staging[g._turn]
    batch.input_ids[0] = 9
    g.fill_host_inputs(batch, [st])
    second = g._staging[g._turn]
    assert first is not second and first.n_ids[0] == 7 and second.n_ids[0] == 9


def test_fill_host_inputs_under_dcp_match_the_layout():
    """Decode context parallelism: each rank stages the slot of the new token only where it
    stores it (attention/dcp.py's layout over logical blocks of dcp * block_size tokens), and
    the local context lengths; exactly one rank of the group writes each token."""
    from kdaserve.attention.dcp import DCPGroup

    rng = random.Random(1)
    bs_tok, n = 16, 2
    for inter in (1, 4, 16):
        states, computed = [], []
        for i in range(7):
            c = rng.randrange(1, 900)
            blocks = rng.sample(range(5000), (c + 1 + n * bs_tok - 1) // (n * bs_tok))
            states.append(CachedRequestState(f"r{i}", [1] * (c + 1), c, SamplingParams(), blocks,
                                             i, c))
            computed.append(c)
        batch = StepBatch([s.req_id for s in states], [5] * 7, [1] * 7, computed, list(range(7)))
        writers = [0] * 7
        for rank in range(n):
            dcp = DCPGroup(n, rank, inter)
            g = make_graphs(8, 64, bs_tok, 40, dcp)
            size, _ = g.fill_host_inputs(batch, states)
            h = g._staging[g._turn]
            for i, (s, c) in enumerate(zip(states, computed)):
                mine = [p for p in range(c + 1) if (p // inter) % n == rank]
                assert h.n_local[i] == len(mine) and h.n_seq[i] == c + 1
                if (c // inter) % n == rank:
                    li = mine.index(c)
                    assert h.n_slot[i] == s.block_ids[li // bs_tok] * bs_tok + li % bs_tok
                    writers[i] += 1
                else:
                    assert h.n_slot[i] == -1
            assert (h.n_slot[7:size] == -1).all() and (h.n_local[7:size] == 1).all()
        assert writers == [1] * 7
