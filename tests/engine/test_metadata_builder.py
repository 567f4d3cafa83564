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
