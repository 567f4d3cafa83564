# SPDX-License-Identifier: Apache-2.0
"""Run in a subprocess with TRITON_INTERPRET=1 and fla-core importable: the CUDA KDA path's
short-row branch (fla's fused recurrent kernel in continuous-batching mode, several tokens per
row, one slot per row) against the CPU reference path, on CPU tensors."""

import types

import torch

from kdaserve.attention import kda_backend
from kdaserve.attention.builder import build_metadata
from tests.kernels.kernel_checks import patch_triton_interpreter


def _gate(h: int, d: int, g: torch.Generator):
    return types.SimpleNamespace(
        lower_bound=None, A_log=torch.randn(1, 1, h, 1, generator=g) * 0.3,
        dt_bias=torch.randn(h * d, generator=g) * 0.3,
        activate=lambda raw, self=None: None)


def main() -> None:
    patch_triton_interpreter()
    from kdaserve.kernels import reference as ref

    g = torch.Generator().manual_seed(0)
    H, D = 2, 16
    gate = _gate(H, D, g)
    gate.activate = lambda raw: ref.kda_gate(raw, gate.A_log, gate.dt_bias, None)
    query_lens, computed, slots = [1, 1, 5, 9, 2], [7, 30, 3, 20, 1], [4, 0, 2, 6, 1]
    md = build_metadata(query_lens, computed, [[0, 1]] * 5, slots, 16, "cpu", num_decodes=2)
    assert kda_backend._all_short_with_state(md)
    T = sum(query_lens)
    q, k = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    v = torch.randn(T, H, D, generator=g)
    g_raw, beta = torch.randn(T, H, D, generator=g), torch.randn(T, H, generator=g)
    pool = torch.randn(8, H, D, D, generator=g) * 0.1
    want_pool, got_pool = pool.clone(), pool.clone()
    want, got = torch.empty_like(v), torch.empty_like(v)
    kda_backend._delta_rule_into(q, k, v, g_raw, beta, gate, md, want_pool, want)  # reference
    kda_backend._delta_rule_cuda(q, k, v, g_raw, beta, gate, md, got_pool, got)   # fla, short rows
    err_o = ((got - want).norm() / want.norm()).item()
    err_s = ((got_pool - want_pool).norm() / want_pool.norm()).item()
    assert err_o < 1e-4 and err_s < 1e-4, (err_o, err_s)
    assert torch.equal(got_pool[[3, 5, 7]], pool[[3, 5, 7]]), "a slot no row owns changed"
    long_md = build_metadata([1, 17], [5, 4], [[0, 1]] * 2, [0, 1], 16, "cpu", num_decodes=1)
    fresh_md = build_metadata([1, 3], [5, 0], [[0, 1]] * 2, [0, 1], 16, "cpu", num_decodes=1)
    assert not kda_backend._all_short_with_state(long_md)
    assert not kda_backend._all_short_with_state(fresh_md)
    print("short rows ok", err_o, err_s)


if __name__ == "__main__":
    main()
