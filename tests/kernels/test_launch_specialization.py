"""The Triton kernels of a serving step specialise the same way whatever the step's composition
(issue 19: no JIT compile after the warm-up). Triton compiles one variant per specialisation key:
each pointer's 16-byte alignment and each specialised int's divisibility by 16 (or == 1). On CPU,
without running any kernel: the launches are recorded and their keys computed with Triton's own
binder, for many token counts, batch sizes and contexts; the non-constexpr part of a kernel's key
must be one value. Also the layout the MoE alignment relies on, and the fixed row stride of the
KDA per-token state slots.
"""

from __future__ import annotations

import sys
import types
from collections import defaultdict

import pytest
import torch

pytest.importorskip("triton")


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kw)` records the non-constexpr part
    of the specialisation key Triton would compile for, launches nothing."""

    def __init__(self, fn, keys: dict):
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import create_function_from_signature

        self.name = fn.__name__
        self.binder = create_function_from_signature(fn.signature, fn.params, BaseBackend)
        self.keys = keys

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _, spec, _ = self.binder(*args, **kwargs)
            key = tuple((i, s) for i, s in enumerate(spec) if s[0] != "constexpr")
            self.keys[self._file_under(spec)].add(key)
        return launch

    def _file_under(self, spec):
        return self.name


def _record(monkeypatch, module, names) -> dict[str, set]:
    keys: dict[str, set] = defaultdict(set)
    for name in names:
        monkeypatch.setattr(module, name, _Recorder(getattr(module, name), keys))
    return keys


def _one_key_each(keys: dict[str, set], where: str) -> None:
    for name, ks in keys.items():
        assert len(ks) == 1, f"{name} ({where}): {len(ks)} specialisations: " + "; ".join(
            str([(i, s[1]) for i, s in k]) for k in sorted(ks))


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------

MOE_KERNELS = ["moe_align_small_kernel", "moe_count_kernel", "moe_offsets_kernel",
               "moe_scatter_kernel", "moe_gemm1_kernel", "moe_gemm2_kernel", "moe_sum_kernel"]


def test_align_workspace_layout_aligned_and_disjoint():
    from kdaserve.kernels.moe.fused_moe import (ALIGN_WS_ELEMS, ALIGN_WS_SECTIONS,
                                                align_workspace_layout)

    for E in (1, 2, 8, 9, 33, 256, 257):
        for max_blocks in (1, 2, 5, 31, 32, 33, 100):
            for max_rows in (1, 7, 16, 100, 1000, 4097):
                layout, size = align_workspace_layout(E, max_blocks, max_rows)
                want = dict(zip(ALIGN_WS_SECTIONS, (E, E, E, 1, max_blocks, max_rows)))
                end = 0
                for name in ALIGN_WS_SECTIONS:
                    start, n = layout[name]
                    assert n == want[name] and start % ALIGN_WS_ELEMS == 0 and start >= end, \
                        (E, max_blocks, max_rows, name, start, n)
                    end = start + n
                assert end <= size, (E, max_blocks, max_rows)


@pytest.mark.parametrize("num_experts,top_k", [(9, 3), (8, 2), (64, 8), (257, 9)])
def test_moe_align_one_specialisation(monkeypatch, num_experts, top_k):
    """Token counts 1..300 (both the one-program and the atomic path): every MoEAlignment field
    is 16-byte aligned and each align kernel has one key, also for routing ids at an unaligned
    offset."""
    from kdaserve.kernels.moe import triton_moe
    from kdaserve.kernels.moe.fused_moe import SMALL_ALIGN_ENTRIES, moe_align_block_size

    keys = _record(monkeypatch, triton_moe, MOE_KERNELS)
    paths = set()
    for n in range(1, 301):
        ids = torch.randint(0, num_experts, (n, top_k), dtype=torch.int32)
        # a view at an odd row offset (a step's rows sliced out of a larger routing tensor)
        ids_view = torch.randint(0, num_experts, (n + 1, top_k), dtype=torch.int32)[1:]
        for block_m, routed in ((16, ids), (64, ids), (16, ids_view)):
            a = moe_align_block_size(routed, num_experts, block_m)
            for field in ("sorted_ids", "expert_ids", "expert_start", "counts", "num_rows"):
                t = getattr(a, field)
                assert t.data_ptr() % 16 == 0, f"N={n} E={num_experts} bm={block_m}: {field}"
        paths.add(n * top_k <= SMALL_ALIGN_ENTRIES)
    _one_key_each(keys, f"E={num_experts} k={top_k}")
    assert "moe_align_small_kernel" in keys
    assert ("moe_count_kernel" in keys) == (False in paths)


def test_fused_moe_gemms_one_specialisation(monkeypatch):
    """fused_moe from 2 to 300 tokens (past one token, which skips the alignment: DIRECT): the
    align, GEMM and sum kernels each have one key."""
    from kdaserve.kernels.moe import fused_moe as fm
    from kdaserve.kernels.moe import triton_moe

    keys = _record(monkeypatch, triton_moe, MOE_KERNELS)
    monkeypatch.setattr(fm, "check_kernel_device", lambda t: None)
    E, D, inter, k = 9, 64, 32, 3
    w13 = torch.randn(E, 2 * inter, D, dtype=torch.bfloat16)
    w2 = torch.randn(E, D, inter, dtype=torch.bfloat16)
    for n in range(2, 301):
        x = torch.randn(n, D, dtype=torch.bfloat16)
        ids = torch.randint(0, E, (n, k), dtype=torch.int32)
        fm.fused_moe(x, w13, w2, torch.rand(n, k), ids)
    _one_key_each(keys, "fused_moe")
    assert {"moe_gemm1_kernel", "moe_gemm2_kernel", "moe_align_small_kernel"} <= set(keys)


# ---------------------------------------------------------------------------------------------
# MLA decode
# ---------------------------------------------------------------------------------------------


def _mla_rows(B: int, H: int, rank: int, rope: int, width: int, page: int, offset: int = 0):
    """q [B, H, rank] and q_pe [B, H, rope] as views of one projection starting `offset` rows
    into it, a zero block table of `width` pages, and full lengths (both `offset` rows into
    larger buffers, as a step's rows after other requests' rows)."""
    proj = torch.randn(offset + B, H, rank + rope, dtype=torch.bfloat16)[offset:]
    table = torch.zeros(offset + B, width, dtype=torch.int32)[offset:]
    lens = torch.full((offset + B,), width * page, dtype=torch.int32)[offset:]
    return proj[..., :rank], proj[..., rank:], table, lens


@pytest.mark.parametrize("return_lse", [False, True])
def test_mla_decode_one_specialisation(monkeypatch, return_lse):
    """Batch sizes 1..40 over block tables of 1..64 pages: the split count (and with it the
    partial buffers' strides, part_lse's row stride among them) varies; each kernel has one
    key."""
    from kdaserve.kernels.mla import decode, triton_decode

    keys = _record(monkeypatch, triton_decode, ["mla_decode_partial_kernel",
                                                "mla_decode_partial_t_kernel",
                                                "mla_decode_reduce_kernel"])
    monkeypatch.setattr(decode, "check_kernel_device", lambda t: None)
    H, rank, rope, page = 4, 32, 8, 16
    kv = torch.randn(64, page, rank + rope, dtype=torch.bfloat16)
    splits = set()
    for B in range(1, 41):
        for width in (1, 3, 8, 64):
            q, q_pe, table, lens = _mla_rows(B, H, rank, rope, width, page)
            decode.mla_decode(q, kv, table, lens, 0.1, rank, q_pe=q_pe, return_lse=return_lse)
            cfg = decode.default_config(B, H, q.dtype)
            splits.add(decode.choose_num_kv_splits(B, -(-H // cfg.block_h), width * page,
                                                   q.device, waves=1 if cfg.transposed else 2))
    assert len(splits) > 4, splits
    _one_key_each(keys, f"return_lse={return_lse}")


def test_mla_verify_windows_one_specialisation(monkeypatch):
    """Verify windows (rows_per_seq > 1, split by sequences), folded and not: 1..12 windows of
    2..9 rows over block tables of 1..64 pages and q at a row offset of a larger projection;
    each kernel has one key."""
    from kdaserve.kernels.mla import decode, triton_decode

    keys = _record(monkeypatch, triton_decode, ["mla_decode_partial_t_kernel",
                                                "mla_decode_partial_fold_kernel",
                                                "mla_decode_reduce_kernel"])
    monkeypatch.setattr(decode, "check_kernel_device", lambda t: None)
    H, rank, rope, page = 32, 32, 8, 16
    kv = torch.randn(64, page, rank + rope, dtype=torch.bfloat16)
    fold = decode.fold_config(H, torch.bfloat16)
    transposed = decode.default_config(64, H, torch.bfloat16)
    for n in range(1, 13):
        for window in (2, 3, 5, 9):
            B = n * window
            for width in (1, 3, 8, 64):
                for offset in (0, 1):
                    q, q_pe, table, lens = _mla_rows(B, H, rank, rope, width, page, offset)
                    for cfg in (fold, transposed):
                        decode.mla_decode(q, kv, table, lens, 0.1, rank, q_pe=q_pe,
                                          rows_per_seq=window, config=cfg)
    _one_key_each(keys, "verify windows")
    assert set(keys) == {"mla_decode_partial_t_kernel", "mla_decode_partial_fold_kernel",
                         "mla_decode_reduce_kernel"}


# ---------------------------------------------------------------------------------------------
# KDA (fla's fused recurrent kernel)
# ---------------------------------------------------------------------------------------------


def test_state_indices_per_token_fixed_stride():
    """fla's kernel takes the row stride of ssm_state_indices as a constexpr: every step whose
    rows are short enough for the one-launch path gives the same stride."""
    from kdaserve.attention.builder import build_metadata
    from kdaserve.attention.kda_backend import SHORT_PREFILL_MAX

    for longest in range(1, SHORT_PREFILL_MAX + 1):
        lens = [1, 1, longest, max(1, longest // 2)]
        md = build_metadata(lens, [5, 9, 3, 40], [[0, 1, 2, 3]] * 4, [4, 1, 7, 2], 16, "cpu")
        idx = md.state_indices_per_token
        assert idx.stride() == (SHORT_PREFILL_MAX, 1), (longest, idx.shape, idx.stride())
        assert torch.equal(idx[:, :longest], md.state_indices[:, None].expand(4, longest))


def test_fla_rows_aligned():
    """The rows handed to fla's kernels are 16-byte aligned at every first row: beta, a column
    slice of a projection whose rows are 130 bf16 (the tiny model's), is copied where its
    one-row view is not aligned; aligned contiguous views are passed as they are."""
    from kdaserve.attention.kda_backend import _fla_rows

    proj = torch.randn(40, 130, dtype=torch.bfloat16)
    beta = proj[:, 128:]                                         # [T, 2]
    planes = torch.randn(3, 40, 2, 16, dtype=torch.bfloat16)    # q | k | v [T, H, K] planes
    for a in range(20):
        for b in (a + 1, a + 2, 40):
            rows = _fla_rows(beta, a, b)
            assert rows.is_contiguous() and rows.data_ptr() % 16 == 0, (a, b)
            assert torch.equal(rows[0], beta[a:b])
            q = _fla_rows(planes[1], a, b)
            assert q.data_ptr() == planes[1, a:b].data_ptr(), (a, b)


def test_checkpoint_remainder_inputs_aligned(monkeypatch):
    """The fused recurrence over an export's off-grid remainder gets 16-byte aligned inputs at
    every offset (views of beta at the remainder's first token are not)."""
    from kdaserve.attention import kda_checkpoint
    from kdaserve.attention.builder import build_metadata
    from kdaserve.attention.metadata import KDACheckpointRequest

    seen = []

    def fake_recurrent(*xs, initial_state, **kw):
        seen.append([x.data_ptr() % 16 for x in xs])
        return None, initial_state

    fla = types.ModuleType("fla.ops.kda")
    fla.fused_recurrent_kda = fake_recurrent
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name, types.ModuleType(name)))
    monkeypatch.setitem(sys.modules, "fla.ops.kda", fla)
    T, H, K = 200, 2, 16
    inputs = tuple(torch.randn(1, T, H, K, dtype=torch.bfloat16) for _ in range(4)) \
        + (torch.randn(1, T, H, dtype=torch.bfloat16),)
    rec_cache = torch.zeros(8, H, K, K)
    for first in (3, 5, 9, 13):
        lens = [first, T - first]
        md = build_metadata(lens, [0, 0], [list(range(16))] * 2, [0, 1], 16, "cpu")
        md.kda_checkpoints = KDACheckpointRequest([0, 1, 1], [first - 1, 7, 70], [5, 6, 7])
        cu = torch.tensor([0, first, T])
        h = torch.zeros(1, 8, H, K, K)
        kda_checkpoint._write_gpu_exports(inputs, dict(cu_seqlens_cpu=cu), h, md, rec_cache)
    assert len(seen) == 12 and all(m == [0] * 5 for m in seen), seen


# ---------------------------------------------------------------------------------------------
# KDA speculative verification (RecoverSSM)
# ---------------------------------------------------------------------------------------------


def test_spec_verify_one_specialisation(monkeypatch):
    """The verification rows are slices of a step's projections at the speculating requests'
    offset (an eager mixed step) or a graph's own buffers: q / k / v / g / beta / x at every row
    offset and row stride, window bounds, slots and columns as views at odd offsets, give one
    key per kernel (kda_spec_verify and its commit, conv_spec_verify, the conv window
    commit)."""
    from kdaserve.kernels.kda import recover, triton_recover

    keys = _record(monkeypatch, triton_recover, ["kda_spec_verify_kernel",
                                                 "kda_recover_commit_kernel",
                                                 "conv_spec_verify_kernel",
                                                 "conv_spec_window_kernel"])
    monkeypatch.setattr(recover, "check_kernel_device", lambda t: None)
    H, K, V, D, W, slots = 2, 16, 16, 24, 4, 9
    pool = torch.zeros(slots, H, K, V)
    conv_pool = torch.zeros(slots, D, W - 1, dtype=torch.bfloat16)
    weight = torch.randn(D, W, dtype=torch.bfloat16)
    for n, k1 in ((1, 2), (3, 5), (4, 9)):
        T = n * k1
        for offset in range(0, 9):
            for extra in (0, 3):                      # the projection's other columns
                width = 3 * H * K + H + extra
                proj = torch.randn(offset + T, width, dtype=torch.bfloat16)[offset:]
                q = proj[:, :H * K].view(T, H, K)
                k = proj[:, H * K:2 * H * K].view(T, H, K)
                v = proj[:, 2 * H * K:3 * H * K].view(T, H, V)
                beta = proj[:, 3 * H * K:3 * H * K + H]
                g = torch.randn(offset + T, H, K)[offset:]
                cu = torch.arange(0, offset + n + 1, dtype=torch.int32)[offset:] * k1 \
                    - offset * k1
                idx = torch.arange(offset, offset + n, dtype=torch.int32) % slots
                cols = torch.zeros(offset + n, dtype=torch.int32)[offset:]
                _, records = recover.kda_spec_verify(q, k, v, g, beta, cu, pool, idx,
                                                     initial_cols=cols, use_triton=True)
                accepted = torch.ones(offset + n, dtype=torch.int32)[offset:]
                recover.kda_recover_commit(pool, idx, records, cu, accepted, use_triton=True)
                x = proj[:, :D]
                recover.conv_spec_verify(x, weight, cu, conv_pool, idx, initial_cols=cols,
                                         use_triton=True)
                recover.conv_recover_commit(conv_pool, idx, x, cu, accepted, use_triton=True)
    _one_key_each(keys, "spec verify")
    assert set(keys) == {"kda_spec_verify_kernel", "kda_recover_commit_kernel",
                         "conv_spec_verify_kernel", "conv_spec_window_kernel"}


def test_window_splits_follow_sequences(monkeypatch):
    """Verify windows split their context by sequences: the 48B model's measured optimum at
    8 / 16 / 32 windows of 8K context (16 / 8 / 4 splits on 132 SMs), powers of two, >= 256
    keys a partition (short contexts included), and mla_decode launches that count for
    rows_per_seq > 1 whatever the window length."""
    from kdaserve.kernels.mla import decode, triton_decode

    cpu = torch.device("cpu")
    assert [decode.window_num_kv_splits(n, 1, 8192, cpu) for n in (8, 16, 32)] == [16, 8, 4]
    for n in (1, 2, 3, 5, 16, 100, 200):
        for ctx in (16, 255, 256, 700, 1000, 3000, 8192, 131072):
            s = decode.window_num_kv_splits(n, 1, ctx, cpu)
            assert s >= 1 and s & (s - 1) == 0, (n, ctx, s)
            assert s == 1 or ctx // s >= 256, (n, ctx, s)
            assert s <= max(1, 132 // n), (n, ctx, s)

    grids = []

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *a, **k: None
    for name in ("mla_decode_partial_t_kernel", "mla_decode_partial_fold_kernel",
                 "mla_decode_reduce_kernel"):
        monkeypatch.setattr(triton_decode, name, Spy())
    monkeypatch.setattr(decode, "check_kernel_device", lambda t: None)
    H, rank, rope, page = 32, 512, 64, 16
    kv = torch.zeros(8, page, rank + rope, dtype=torch.bfloat16)
    for window in (3, 5, 9):
        for config in (None, decode.fold_config(H, torch.bfloat16)):
            grids.clear()
            B = 16 * window
            q = torch.zeros(B, H, rank + rope, dtype=torch.bfloat16)
            table = torch.zeros(B, 512, dtype=torch.int32)      # 8192 keys of context
            lens = torch.full((B,), 8192, dtype=torch.int32)
            decode.mla_decode(q, kv, table, lens, 0.1, rank, rows_per_seq=window, config=config)
            assert grids[0][1] == 8, (window, config, grids[0])   # 16 sequences: 8 splits


# ---------------------------------------------------------------------------------------------
# Sampling (top-k / top-p threshold search, exponential race, split softmax)
# ---------------------------------------------------------------------------------------------


class _VariantRecorder(_Recorder):
    """A _Recorder that files each launch's key under its kernel and constexpr values: one
    kernel's variants by design (MARKOV, FIRST, ...) are told apart from accidental ones."""

    def _file_under(self, spec):
        return self.name, repr(tuple(s[1] for s in spec if s[0] == "constexpr"))


@pytest.mark.parametrize("filters", ["top_p", "top_k", "top_k + top_p"])
def test_sampling_kernels_one_specialisation(monkeypatch, filters):
    """The sampler's kernels at 1..144 rows of the model's vocabulary (a verify step of 16
    windows of 9 is 144 rows), the per-row inputs (top_k, top_p, temperature, seeds, previous
    tokens) cut at any offset of a larger buffer: each kernel variant (its constexprs) has one
    key per filter combination, so a new batch size or a metadata row offset compiles nothing.
    The search state's per-pass slots sit at multiples of B x (pivots + 8) fp64 values: aligned
    at every B."""
    from kdaserve.kernels.sample import race, softmax, top_p, triton_race, triton_softmax, \
        triton_top_p

    keys: dict = defaultdict(set)
    for module, names in ((triton_top_p, ["split_stats_kernel", "search_pass_kernel",
                                          "narrow_kernel"]),
                          (triton_race, ["race_partial_kernel", "race_reduce_kernel"]),
                          (triton_softmax, ["softmax_stats_kernel", "softmax_write_kernel"])):
        for name in names:
            monkeypatch.setattr(module, name, _VariantRecorder(getattr(module, name), keys))
    for module in (top_p, race, softmax):
        monkeypatch.setattr(module, "check_kernel_device", lambda t: None)
    V, rank = 163840, 32
    emb = torch.zeros(V, rank, dtype=torch.bfloat16)
    proj = torch.zeros(V, rank, dtype=torch.bfloat16)
    for B in (1, 2, 3, 4, 7, 9, 16, 33, 64, 144):
        logits = torch.zeros(B, V)
        for offset in (0, 1, 3):
            k = torch.full((B + offset,), 50, dtype=torch.int32)[offset:]
            p = torch.full((B + offset,), 0.95)[offset:]
            temp = torch.ones(B + offset)[offset:]
            seeds = torch.arange(B + offset)[offset:]
            prev = torch.zeros(B + offset, dtype=torch.int64)[offset:]
            kk = k if "top_k" in filters else None
            pp = p if "top_p" in filters else None
            tau = top_p.top_k_top_p_threshold(logits, kk, pp)
            race.race_sample(logits, seeds, tau, temp)
            race.markov_race(logits, emb, proj, prev, seeds, temp)
            softmax.tempered_softmax(logits, temp, seeds)
    assert {name for name, _ in keys} == {
        "split_stats_kernel", "search_pass_kernel", "narrow_kernel", "race_partial_kernel",
        "race_reduce_kernel", "softmax_stats_kernel", "softmax_write_kernel"}
    _one_key_each({f"{name} {consts}": ks for (name, consts), ks in keys.items()}, filters)
