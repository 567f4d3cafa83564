"""Shared correctness checks for the Triton kernels (run on CUDA, or on CPU under TRITON_INTERPRET=1).

Each check draws fresh random inputs, poisons outputs with NaN, runs the kernel and its
plain-PyTorch twin from kdaserve.kernels.reference, and asserts the relative error
||out - ref|| / ||ref|| is under the bound for the dtype.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


def run_under_interpreter(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run tests/kernels/<script> in a subprocess with TRITON_INTERPRET=1 (CPU tensors) and the
    repo on PYTHONPATH; the caller asserts on the result."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(here.parents[1]), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(here / script)], env=env, capture_output=True,
                          text=True, timeout=timeout)


def patch_triton_interpreter() -> None:
    """Two fixes to Triton 3.6's interpreter and one addition. It turns 1-element scalars into
    ints with int(ndarray), which NumPy >= 2.4 rejects (dynamic loop bounds, range(start, end),
    then fail): use .item() instead. Its tl.dot multiplies bf16 operands as their raw 16-bit
    patterns (NumPy has no bf16): widen them to fp32 first (bf16 products are exact in fp32).
    It has no inline asm: run the PTX through ptx_model.py (the instructions our kernels use)."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    if getattr(interp, "_kdaserve_patched", False):
        return
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        tensor.__index__ = lambda self: int(self.handle.data.item())

    interp._patch_lang_tensor = patched
    builder = interp.InterpreterBuilder
    dot = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint16).astype(np.uint32) << 16
        return interp.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        # PTX through tests/kernels/ptx_model.py (the interpreter has no inline asm)
        from ptx_model import run_inline_asm

        shape = np.broadcast_shapes(*(v.data.shape for v in values))
        raw = []
        for v in values:
            bits = v.dtype.scalar.primitive_bitwidth
            data = np.broadcast_to(v.data, shape).reshape(-1)
            raw.append((data.view(getattr(np, f"uint{data.itemsize * 8}")), bits))
        scalars = [t.scalar for t in types]
        outs = run_inline_asm(asm, constraints, raw, [t.primitive_bitwidth for t in scalars],
                              pack)

        class Results:
            def get_result(self, i):
                data = outs[i].view(interp._get_np_dtype(scalars[i])).reshape(shape)
                return interp.TensorHandle(data, scalars[i])

        return Results()

    builder.create_inline_asm = create_inline_asm
    interp._kdaserve_patched = True


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bound(dtype: torch.dtype) -> float:
    return 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), f"{name}: NaN in output (unwritten rows?)"
    err = rel_err(out, ref)
    assert err <= bound(dtype), f"{name}: relative error {err:.3e} > {bound(dtype):.0e}"


def _gen(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def make_paged_kv(device, dtype, seq_lens, page, dim, num_blocks=None, seed=0):
    """A random cache and a shuffled block table covering seq_lens (+1 spare block per row)."""
    g = _gen(device, seed)
    max_blocks = max(-(-s // page) for s in seq_lens) + 1
    num_blocks = num_blocks or len(seq_lens) * max_blocks + 3
    kv = torch.randn(num_blocks, page, dim, generator=g, device=device).to(dtype)
    perm = torch.randperm(num_blocks, generator=g, device=device)
    bt = perm[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).int()
    return kv, bt


def check_mla_decode(device, dtype, seq_lens, num_heads=16, page=16, kv_lora_rank=512, rope=64,
                     num_kv_splits=None, config=None, seed=0, split_q=False):
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.mla.decode import mla_decode

    B, D = len(seq_lens), kv_lora_rank + rope
    kv, bt = make_paged_kv(device, dtype, seq_lens, page, D, seed=seed)
    q = torch.randn(B, num_heads, D, generator=_gen(device, seed + 1), device=device).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = 192 ** -0.5
    out = torch.full((B, num_heads, kv_lora_rank), float("nan"), dtype=dtype, device=device)
    if split_q:   # latent and rope parts as two strided views of other tensors (no concat)
        wide = torch.randn(num_heads, B, kv_lora_rank + 8, generator=_gen(device, seed + 2),
                           device=device).to(dtype)
        wide[:, :, :kv_lora_rank] = q[..., :kv_lora_rank].transpose(0, 1)
        q_pe = torch.zeros(B, num_heads, rope + 32, dtype=dtype, device=device)
        q_pe[..., 5:5 + rope] = q[..., kv_lora_rank:]
        mla_decode(wide[:, :, :kv_lora_rank].transpose(0, 1), kv, bt, sl, scale, kv_lora_rank,
                   out=out, num_kv_splits=num_kv_splits, config=config,
                   q_pe=q_pe[..., 5:5 + rope])
    else:
        mla_decode(q, kv, bt, sl, scale, kv_lora_rank, out=out, num_kv_splits=num_kv_splits,
                   config=config)
    want = ref.mla_decode(q.double(), kv.double(), bt, sl, scale, kv_lora_rank)
    assert_close(f"mla_decode{tuple(seq_lens)} page={page}", out, want, dtype)
    for b, s in enumerate(seq_lens):
        if s == 0:
            assert (out[b] == 0).all(), "empty sequence must give zeros"


def check_mla_decode_fold(device, dtype, lens, rows_per_seq, config, num_heads=16, page=16,
                          kv_lora_rank=64, rope=16, num_kv_splits=None, seed=0):
    """Verify windows through mla_decode(rows_per_seq=T) with config.rows > 1 (the fold
    kernel): a sequence of length L has T rows of lengths L - T + 1 .. L (clamped at 0) on one
    block table; output and lse against the reference, row by row."""
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.mla.decode import mla_decode

    T, D = rows_per_seq, kv_lora_rank + rope
    kv, bt = make_paged_kv(device, dtype, lens, page, D, seed=seed)
    bt = bt.repeat_interleave(T, dim=0)
    lengths = [max(0, L - T + 1 + j) for L in lens for j in range(T)]
    B = len(lengths)
    q = torch.randn(B, num_heads, D, generator=_gen(device, seed + 1), device=device).to(dtype)
    sl = torch.tensor(lengths, dtype=torch.int32, device=device)
    scale = 192 ** -0.5
    out = torch.full((B, num_heads, kv_lora_rank), float("nan"), dtype=dtype, device=device)
    _, lse = mla_decode(q, kv, bt, sl, scale, kv_lora_rank, out=out, config=config,
                        num_kv_splits=num_kv_splits, rows_per_seq=T, return_lse=True)
    want, want_lse = ref.mla_decode(q.double(), kv.double(), bt, sl, scale, kv_lora_rank,
                                    return_lse=True)
    name = f"mla_decode fold{tuple(lens)} T={T} rows={config.rows} H={num_heads}"
    assert_close(name, out, want, dtype)
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse)), f"{name}: lse -inf rows differ"
    assert_close(name + " lse", lse[finite], want_lse[finite], dtype)
    for b, s in enumerate(lengths):
        if s == 0:
            assert (out[b] == 0).all(), f"{name}: an empty row must give zeros"


def check_mla_decode_lse(device, dtype, seq_lens, num_heads=16, page=16, kv_lora_rank=512,
                         rope=64, num_kv_splits=None, seed=0):
    """mla_decode(return_lse=True): output and lse against the reference's (lse -inf and
    output 0 for an empty sequence)."""
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.mla.decode import mla_decode

    B, D = len(seq_lens), kv_lora_rank + rope
    kv, bt = make_paged_kv(device, dtype, seq_lens, page, D, seed=seed)
    q = torch.randn(B, num_heads, D, generator=_gen(device, seed + 1), device=device).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = 192 ** -0.5
    out, lse = mla_decode(q, kv, bt, sl, scale, kv_lora_rank, num_kv_splits=num_kv_splits,
                          return_lse=True)
    want, want_lse = ref.mla_decode(q.double(), kv.double(), bt, sl, scale, kv_lora_rank,
                                    return_lse=True)
    assert_close(f"mla_decode+lse{tuple(seq_lens)} out", out, want, dtype)
    assert lse.dtype == torch.float32 and lse.shape == (B, num_heads)
    for b, s in enumerate(seq_lens):
        if s == 0:
            assert torch.isneginf(lse[b]).all() and (out[b] == 0).all(), "empty row"
        else:
            err = (lse[b].double() - want_lse[b]).abs().max().item()
            assert err <= 50 * bound(dtype), f"lse row {b}: max abs error {err:.3e}"


def split_paged_kv(kv, bt, seq_lens, owner, num_parts, page):
    """Split each sequence's cached keys into num_parts disjoint sets, position order kept:
    position p of row b goes to part owner(b, p). Returns per part (cache, block_table,
    seq_lens) with the part's keys packed from local position 0."""
    from kdaserve.kernels import reference as ref

    device, B = kv.device, len(seq_lens)
    parts = []
    for n in range(num_parts):
        rows = []
        for b, s in enumerate(seq_lens):
            full = ref.paged_gather(kv, bt[b], s)                         # [s, D]
            keep = [p for p in range(s) if owner(b, p) == n]
            rows.append(full[keep])
        max_blocks = max(-(-len(r) // page) for r in rows) + 1
        cache = torch.zeros(B * max_blocks, page, kv.shape[-1], dtype=kv.dtype, device=device)
        table = torch.arange(B * max_blocks, device=device).view(B, max_blocks).flip(1)
        table = table.int().contiguous()                                  # not in order
        for b, r in enumerate(rows):
            flat = cache[table[b].long()].reshape(-1, kv.shape[-1])
            flat[:len(r)] = r
            cache[table[b].long()] = flat.view(max_blocks, page, -1)
        lens = torch.tensor([len(r) for r in rows], dtype=torch.int32, device=device)
        parts.append((cache, table, lens))
    return parts


def check_mla_split_merge(device, dtype, seq_lens, owner, num_parts=2, num_heads=16, page=16,
                          kv_lora_rank=64, rope=16, seed=0, triton=True):
    """Attention over keys split into disjoint sets, merged by the lse, equals attention over
    all keys (the decode-context-parallel identity). triton: the Triton decode and merge;
    otherwise their reference twins."""
    from kdaserve.kernels import reference as ref

    if triton:
        from kdaserve.kernels.mla.decode import mla_decode
        from kdaserve.kernels.mla.merge import merge_attn_states
    else:
        mla_decode, merge_attn_states = ref.mla_decode, ref.merge_attn_states
    B, D = len(seq_lens), kv_lora_rank + rope
    kv, bt = make_paged_kv(device, dtype, seq_lens, page, D, seed=seed)
    q = torch.randn(B, num_heads, D, generator=_gen(device, seed + 1), device=device).to(dtype)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = 192 ** -0.5
    outs, lses = [], []
    for cache, table, lens in split_paged_kv(kv, bt, seq_lens, owner, num_parts, page):
        o, l = mla_decode(q, cache, table, lens, scale, kv_lora_rank, return_lse=True)
        outs.append(o)
        lses.append(l)
    merged, lse = merge_attn_states(torch.stack(outs), torch.stack(lses))
    want, want_lse = ref.mla_decode(q.double(), kv.double(), bt, sl, scale, kv_lora_rank,
                                    return_lse=True)
    assert_close(f"split-merge{tuple(seq_lens)}", merged, want, dtype)
    for b, s in enumerate(seq_lens):
        if s == 0:
            assert torch.isneginf(lse[b]).all() and (merged[b] == 0).all(), "empty row"
        else:
            err = (lse[b].double() - want_lse[b]).abs().max().item()
            assert err <= 50 * bound(dtype), f"merged lse row {b}: max abs error {err:.3e}"


def check_merge_attn_states(device, dtype, num_parts=3, rows=5, heads=4, dim=40, seed=0):
    """Triton merge vs the reference on strided partials ([out | lse] packed rows), with
    empty partials (-inf) and a row empty in every partial."""
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.mla.merge import merge_attn_states

    g = _gen(device, seed)
    packed = torch.randn(num_parts, rows, heads, dim + 1, generator=g, device=device)
    packed[..., dim] *= 4
    packed[0, 1, :, dim] = float("-inf")          # partial 0 saw no key for row 1
    packed[:, 2, 1, dim] = float("-inf")          # row 2, head 1: no key anywhere
    outs, lses = packed[..., :dim].to(dtype), packed[..., dim]
    if dtype == torch.float32:
        outs = packed[..., :dim]                  # keep the strided view
    out = torch.full((rows, heads, dim), float("nan"), dtype=dtype, device=device)
    got, lse = merge_attn_states(outs, lses, out=out)
    want, want_lse = ref.merge_attn_states(outs.double(), lses.double())
    assert got is out
    assert_close("merge_attn_states", got, want, dtype)
    assert (got[2, 1] == 0).all() and torch.isneginf(lse[2, 1])
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    err = (lse[fin].double() - want_lse[fin]).abs().max().item()
    assert err <= 10 * bound(dtype), f"merged lse: max abs error {err:.3e}"
    only = merge_attn_states(outs, lses, return_lse=False)
    assert torch.equal(only, got)


def dcp_owner(dcp: int, interleave: int):
    """Decode context parallelism's token owner: position p on rank (p // interleave) % dcp."""
    return lambda b, p: (p // interleave) % dcp


def run_mla_merge_suite() -> None:
    """The interpreter subset for the lse outputs and the merge (fp32)."""
    patch_triton_interpreter()
    f32 = torch.float32
    check_mla_decode_lse("cpu", f32, [0, 37, 150], page=16, num_kv_splits=3, kv_lora_rank=64,
                         rope=16)
    check_mla_decode_lse("cpu", f32, [70, 1], page=64, kv_lora_rank=64, rope=16)
    check_merge_attn_states("cpu", f32)
    check_merge_attn_states("cpu", f32, num_parts=1, seed=1)
    check_mla_split_merge("cpu", f32, [1, 2, 37, 90], dcp_owner(2, 1))
    check_mla_split_merge("cpu", f32, [0, 5, 40, 129], dcp_owner(2, 16), page=16)
    check_mla_split_merge("cpu", f32, [3, 64, 100], dcp_owner(4, 2), num_parts=4)
    check_mla_split_merge("cpu", f32, [50, 17], lambda b, p: int(p < 20))   # two halves


def check_store_latent(device, dtype, num_tokens=37, page=16, rank=512, rope=64, seed=0):
    """Fused kv_a norm + store against reference.store_latent; ckv is a row-strided view."""
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.mla.decode import store_latent

    g = _gen(device, seed)
    dim = rank + rope
    num_pages = num_tokens // page + 2  # room for every token
    cache = torch.randn(num_pages, page, dim, generator=g, device=device).to(dtype)
    slots = torch.randperm(num_pages * page, generator=g, device=device)[:num_tokens]
    slots[::5] = -1
    wide = (torch.randn(num_tokens, dim + 40, generator=g, device=device) * 3).to(dtype)
    ckv = wide[:, 40:]
    weight = (torch.rand(rank, generator=g, device=device) + 0.5).to(dtype)
    want = cache.clone()
    ref.store_latent(want, slots, ckv, weight, 1e-6)
    store_latent(cache, slots, ckv, weight, 1e-6)
    assert_close(f"store_latent T={num_tokens}", cache, want, dtype)


def check_store_kv(device, dtype, num_tokens=37, page=16, dim=576, seed=0):
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.mla.decode import store_kv

    g = _gen(device, seed)
    cache = torch.randn(8, page, dim, generator=g, device=device).to(dtype)
    slots = torch.randperm(8 * page, generator=g, device=device)[:num_tokens]
    slots[::5] = -1
    kv = torch.randn(num_tokens, dim, generator=g, device=device).to(dtype)
    want = cache.clone()
    ref.store_kv(want, slots, kv)
    store_kv(cache, slots, kv)
    assert torch.equal(cache, want), "store_kv differs from reference.store_kv"


def make_routing(device, num_tokens, num_experts, top_k, same_experts=False, seed=0):
    from kdaserve.kernels import reference as ref

    g = _gen(device, seed)
    logits = torch.randn(num_tokens, num_experts, generator=g, device=device)
    bias = torch.randn(num_experts, generator=g, device=device) * 0.1
    weights, ids = ref.moe_topk_sigmoid(logits, bias, top_k, True, 2.446)
    if same_experts:
        chosen = torch.randperm(num_experts, generator=g, device=device)[:top_k]
        ids = chosen.expand(num_tokens, top_k).contiguous()
    return weights, ids.int()


def check_fused_moe(device, dtype, num_tokens, hidden=256, inter=128, num_experts=16, top_k=4,
                    same_experts=False, drop_some=False, seed=0, config=None):
    """config: the FusedMoEConfig to run (default_config's when None)."""
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.moe.fused_moe import fused_moe

    g = _gen(device, seed)
    x = torch.randn(num_tokens, hidden, generator=g, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device)
           * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g, device=device)
          * inter ** -0.5).to(dtype)
    weights, ids = make_routing(device, num_tokens, num_experts, top_k, same_experts, seed + 1)
    if drop_some:                       # ids outside [0, E) contribute nothing
        ids[::3, 0] = -1
    out = torch.full((num_tokens, hidden), float("nan"), dtype=dtype, device=device)
    fused_moe(x, w13, w2, weights, ids, out=out, config=config)
    keep = ids >= 0
    want = ref.moe_experts(x.double(), w13.double(), w2.double(),
                           torch.where(keep, weights, 0.0), ids.clamp(min=0).long())
    tma = " tma" if config is not None and config.gemm1.tma_weights else ""
    assert_close(f"fused_moe N={num_tokens} same={same_experts}{tma}", out, want, dtype)


def check_fused_moe_gemm2_sum(device, dtype, hidden=64, inter=48, num_experts=8, top_k=3,
                               bad_id=None, config=None, against_old=False, shared=False,
                               seed=0):
    """N == 1 through the fused GEMM 2 + top-k sum kernel (config.gemm2_sum, the default when
    config is None) against reference.moe_experts; bad_id (-1 or >= E) replaces entry 1's expert
    (it must contribute nothing). against_old: also compare with gemm2 + moe_sum (gemm2_sum=None).
    shared: like the model, top_k - 1 routed over E - 1 experts plus expert E - 1 at weight 1."""
    from dataclasses import replace

    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.moe.fused_moe import default_config, fit_config, fused_moe

    g = _gen(device, seed)
    x = torch.randn(1, hidden, generator=g, device=device).to(dtype)                # [1, D]
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device)
           * hidden ** -0.5).to(dtype)                                               # [E, 2I, D]
    w2 = (torch.randn(num_experts, hidden, inter, generator=g, device=device)
          * inter ** -0.5).to(dtype)                                                 # [E, D, I]
    if shared:
        weights, ids = make_routing(device, 1, num_experts - 1, top_k - 1, seed=seed + 1)
        weights = torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1)        # [1, k]
        ids = torch.cat([ids, torch.full_like(ids[:, :1], num_experts - 1)], dim=1)
    else:
        weights, ids = make_routing(device, 1, num_experts, top_k, seed=seed + 1)    # [1, k]
    if bad_id is not None:
        ids[0, 1] = bad_id
    cfg = config or fit_config(default_config(1, top_k, num_experts, dtype), hidden, inter)
    assert cfg.gemm2_sum is not None, "the gemm2_sum check needs a gemm2_sum config"
    out = torch.full((1, hidden), float("nan"), dtype=dtype, device=device)
    fused_moe(x, w13, w2, weights, ids, out=out, config=cfg)
    keep = (ids >= 0) & (ids < num_experts)
    want = ref.moe_experts(x.double(), w13.double(), w2.double(),
                           torch.where(keep, weights, 0.0), torch.where(keep, ids, 0).long())
    name = f"fused_moe N=1 gemm2_sum {cfg.gemm2_sum} bad_id={bad_id}"
    assert_close(name, out, want, dtype)
    if against_old:
        old = fused_moe(x, w13, w2, weights, ids, config=replace(cfg, gemm2_sum=None))
        assert_close(name + " vs gemm2+moe_sum", out, old, dtype)


def check_gemm2_sum_rejects_bad_tiles(device):
    """gemm2_sum tiles are tl.arange sizes: a non-power-of-two one is a ValueError naming it."""
    from dataclasses import replace

    from kdaserve.kernels.moe.fused_moe import default_config, fused_moe

    cfg = default_config(1, 2, 4, torch.float32)
    cfg = replace(cfg, gemm2_sum=replace(cfg.gemm2_sum, block_k=24))
    args = (torch.randn(1, 16, device=device), torch.randn(4, 16, 16, device=device),
            torch.randn(4, 16, 8, device=device), torch.rand(1, 2, device=device),
            torch.zeros(1, 2, dtype=torch.int32, device=device))
    try:
        fused_moe(*args, config=cfg)
    except ValueError as exc:
        assert "gemm2_sum.block_k must be a power of two, got 24" in str(exc), str(exc)
    else:
        raise AssertionError("gemm2_sum block_k=24 was accepted")


def align_reference(flat, num_experts, block_m, max_blocks):
    """Plain-PyTorch alignment of flat entry ids [T] (ids outside [0, E) dropped): a stable sort
    by expert. Returns counts [E], start [E], rows [V] and order [V] (the V routed entries in
    expert-then-entry order, order[i] belonging in padded row rows[i]), expert_ids [max_blocks]
    (-1 tail) and num_rows."""
    flat = flat.long().cpu()
    ok = (flat >= 0) & (flat < num_experts)
    counts = torch.bincount(flat[ok], minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(padded, 0) - padded
    order = torch.sort(torch.where(ok, flat, num_experts), stable=True).indices[:int(ok.sum())]
    first = torch.cumsum(counts, 0) - counts                    # unpadded start in `order`
    e_sorted = flat[order]
    rank = torch.arange(order.numel()) - first[e_sorted]
    rows = start[e_sorted] + rank                                # [valid] padded row of each
    blocks = torch.repeat_interleave(torch.arange(num_experts), padded // block_m)
    expert_ids = torch.full((max_blocks,), -1, dtype=torch.long)
    expert_ids[:blocks.numel()] = blocks
    return counts, start, rows, order, expert_ids, int(padded.sum())


def check_moe_align(device, num_tokens, top_k, num_experts, block_m, same_experts=False,
                    seed=0):
    """moe_align_block_size vs align_reference. Ids -1, E and far past E are dropped. On the
    one-program path (<= SMALL_ALIGN_ENTRIES entries) an expert's entries must be in entry order;
    on the atomic path only as a set."""
    from kdaserve.kernels.moe.fused_moe import SMALL_ALIGN_ENTRIES, moe_align_block_size

    _, ids = make_routing(device, num_tokens, num_experts, top_k, same_experts, seed=seed)
    ids[::4, -1] = -1
    ids[1::5, 0] = num_experts
    ids[2::7, -1] = num_experts + 700                # past next_power_of_2(E) too
    a = moe_align_block_size(ids, num_experts, block_m)
    counts, start, rows, order, expert_ids, num_rows = align_reference(
        ids.reshape(-1), num_experts, block_m, a.max_blocks)
    where = f"align T={ids.numel()} E={num_experts} block_m={block_m}"
    assert torch.equal(a.counts.cpu().long(), counts), f"{where}: counts differ"
    assert torch.equal(a.expert_start.cpu().long(), start), f"{where}: expert starts differ"
    assert int(a.num_rows) == num_rows, f"{where}: num_rows {int(a.num_rows)} != {num_rows}"
    assert torch.equal(a.expert_ids.cpu().long(), expert_ids), f"{where}: block -> expert map"
    got = a.sorted_ids.cpu().long()[rows]
    if ids.numel() <= SMALL_ALIGN_ENTRIES:
        assert torch.equal(got, order), f"{where}: sorted_ids not in entry order per expert"
    else:
        e_sorted = ids.reshape(-1).long().cpu()[order]
        key = e_sorted * ids.numel()
        assert torch.equal((key + got).sort().values, (key + order).sort().values), \
            f"{where}: entries of an expert differ"


def check_conv_varlen(device, dtype, seq_lens, dim=96, width=4, num_slots=None, pad_rows=3,
                      seed=0, tiles=None):
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.conv.causal_conv1d import causal_conv1d_varlen

    g = _gen(device, seed)
    B = len(seq_lens)
    num_slots = num_slots or 2 * B + 1
    cu = torch.tensor([0] + torch.tensor(seq_lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=device)
    T = int(cu[-1]) + pad_rows
    x = torch.randn(T, dim, generator=g, device=device).to(dtype)
    w = torch.randn(dim, width, generator=g, device=device) * 0.5
    states = torch.randn(num_slots, dim, width - 1, generator=g, device=device).to(dtype)
    idx = torch.randperm(num_slots, generator=g, device=device)[:B].int()
    if B > 2:
        idx[1] = -1                                          # a padding sequence
    has = torch.rand(B, generator=g, device=device) < 0.6
    st_k, st_r = states.clone(), states.double()
    y = torch.full_like(x, float("nan"))
    causal_conv1d_varlen(x, w, cu, st_k, idx, has, out=y, tiles=tiles)
    want = ref.causal_conv1d_varlen(x.double(), w.double(), cu, st_r, idx, has)
    assert_close(f"conv_varlen{tuple(seq_lens)} W={width} tiles={tiles}", y,
                 want, dtype)
    assert_close("conv_varlen state", st_k, st_r, dtype)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=device)
    untouched[idx[idx >= 0].long()] = False
    assert torch.equal(st_k[untouched], states[untouched]), "slots not in state_indices changed"


def check_conv_update(device, dtype, batch=5, dim=96, width=4, seed=0):
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.conv.causal_conv1d import causal_conv1d_update

    g = _gen(device, seed)
    num_slots = 2 * batch + 1
    x = torch.randn(batch, dim, generator=g, device=device).to(dtype)
    w = torch.randn(dim, width, generator=g, device=device) * 0.5
    states = torch.randn(num_slots, dim, width - 1, generator=g, device=device).to(dtype)
    idx = torch.randperm(num_slots, generator=g, device=device)[:batch].int()
    idx[-1] = -1
    st_k, st_r = states.clone(), states.double()
    y = torch.full_like(x, float("nan"))
    causal_conv1d_update(x, w, st_k, idx, out=y)
    want = ref.causal_conv1d_update(x.double(), w.double(), st_r, idx)
    assert_close("conv_update", y, want, dtype)
    assert_close("conv_update state", st_k, st_r, dtype)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=device)
    untouched[idx[idx >= 0].long()] = False
    assert torch.equal(st_k[untouched], states[untouched]), "slots not in state_indices changed"


def check_mla_prefill_attention(device, dtype, q_len=37, kv_len=None, H=3, nope=16, rope=16,
                                v=16, tiles=None, seed=0):
    """mla_prefill_attention against the fp64 twin on strided inputs as the engine has them (q
    a slice of the batch's rows, k_pe the latents' rope columns, out rows of the batch's
    output); kv_len > q_len: a chunk after cached context. Every row and column written, no
    neighbouring row touched."""
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.mla.prefill_attn import mla_prefill_attention

    kv_len = q_len if kv_len is None else kv_len
    gen = torch.Generator().manual_seed(seed)
    q_all = torch.randn(q_len + 3, H, nope + rope, generator=gen).to(device=device, dtype=dtype)
    q = q_all[2:2 + q_len]
    kv = torch.randn(kv_len, H, nope + v, generator=gen).to(device=device, dtype=dtype)
    latent = torch.randn(kv_len, 5 + rope, generator=gen).to(device=device, dtype=dtype)
    k_pe = latent[:, 5:]
    out_all = torch.full((q_len + 3, H, v), float("nan"), device=device, dtype=dtype)
    mla_prefill_attention(q, kv, k_pe, 0.7 / (nope + rope) ** 0.5, out=out_all[1:1 + q_len],
                          tiles=tiles)
    want = ref.mla_prefill_attention(q.cpu().double(), kv.cpu().double(), k_pe.cpu().double(),
                                     0.7 / (nope + rope) ** 0.5)
    out_all = out_all.cpu()
    assert_close(f"mla_prefill_attention q_len={q_len} kv_len={kv_len}", out_all[1:1 + q_len],
                 want, dtype)
    assert torch.isnan(out_all[0]).all() and torch.isnan(out_all[1 + q_len:]).all(), \
        "mla_prefill_attention wrote outside its rows"


def check_router(device, num_tokens=37, num_experts=256, top_k=8, renormalize=True, bias=True,
                 logits_dtype=torch.float32, seed=0):
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.moe.router import moe_topk_sigmoid

    g = _gen(device, seed)
    logits = torch.randn(num_tokens, num_experts, generator=g, device=device).to(logits_dtype)
    b = torch.randn(num_experts, generator=g, device=device) * 0.3 if bias else None
    w, ids = moe_topk_sigmoid(logits, b, top_k, renormalize, 2.446)
    zero = torch.zeros(num_experts, device=device)
    w_ref, ids_ref = ref.moe_topk_sigmoid(logits, b if bias else zero, top_k, renormalize, 2.446)
    order, order_ref = ids.long().sort(dim=1), ids_ref.long().sort(dim=1)
    assert torch.equal(order.values, order_ref.values), "router picked different experts"
    w_sorted = w.gather(1, order.indices)
    w_ref_sorted = w_ref.gather(1, order_ref.indices)
    assert_close("router weights", w_sorted, w_ref_sorted, torch.float32)


def run_interpreter_suite() -> None:
    """The CPU interpreter subset (fp32; the interpreter's bf16 tl.dot is wrong in Triton 3.6)."""
    from kdaserve.kernels.mla.decode import MLADecodeConfig
    from kdaserve.kernels.moe.fused_moe import FusedMoEConfig, MoEGemmConfig

    patch_triton_interpreter()
    f32 = torch.float32
    check_mla_decode("cpu", f32, [0, 37, 150], page=16, num_kv_splits=3)
    check_mla_decode("cpu", f32, [70, 1], page=64)
    check_mla_decode("cpu", f32, [0, 37, 150], page=16, num_kv_splits=3, split_q=True)
    check_mla_decode("cpu", f32, [70, 9], page=16, split_q=True,
                     config=MLADecodeConfig(16, 16, 4, 1, transposed=True))
    check_mla_decode("cpu", f32, [0, 37, 150], page=16, num_kv_splits=3,
                     config=MLADecodeConfig(16, 16, 4, 1, transposed=True))
    fold = MLADecodeConfig(16, 16, 4, 1, transposed=True, rows=2)
    check_mla_decode_fold("cpu", f32, [37, 150, 2], 3, fold, num_kv_splits=3)
    check_mla_decode_fold("cpu", f32, [0, 70], 5, MLADecodeConfig(16, 16, 4, 2, True, rows=4),
                          num_heads=24)
    check_store_kv("cpu", f32)
    check_store_latent("cpu", f32)
    check_store_latent("cpu", f32, num_tokens=5, rank=48, rope=16)
    check_fused_moe("cpu", f32, 1, hidden=64, inter=48, num_experts=8, top_k=3)
    check_fused_moe_gemm2_sum("cpu", f32, against_old=True, shared=True)
    check_fused_moe_gemm2_sum("cpu", f32, bad_id=-1)
    check_fused_moe_gemm2_sum("cpu", f32, bad_id=8, seed=2)
    # D = 60 not a multiple of BLOCK_N = 16, I = 40 not a multiple of BLOCK_K = 16 (masking);
    # 2 stages so the sm_90 compile test also builds the pipelined loop
    c = MoEGemmConfig(16, 32, 32, 1, 4, 1)
    check_fused_moe_gemm2_sum("cpu", f32, hidden=60, inter=40, top_k=4, bad_id=11,
                               config=FusedMoEConfig(c, c, MoEGemmConfig(1, 16, 16, 1, 4, 2)))
    check_gemm2_sum_rejects_bad_tiles("cpu")
    check_fused_moe("cpu", f32, 19, hidden=64, inter=48, num_experts=8, top_k=3, drop_some=True)
    # expert weights by TMA descriptors: K tails (56 % 16, 40 % 32) and N tiles that cross the
    # gate / up halves (40 % 32) and the last expert's end
    tma = MoEGemmConfig(16, 16, 16, 1, 4, 1, tma_weights=True)
    check_fused_moe("cpu", f32, 30, hidden=64, inter=48, num_experts=8, top_k=3, drop_some=True,
                    config=FusedMoEConfig(tma, tma))
    check_fused_moe("cpu", f32, 19, hidden=56, inter=40, num_experts=8, top_k=3,
                    config=FusedMoEConfig(MoEGemmConfig(16, 32, 16, 1, 4, 2, tma_weights=True),
                                          MoEGemmConfig(16, 32, 32, 1, 4, 2, tma_weights=True)))
    check_fused_moe("cpu", f32, 30, hidden=64, inter=48, num_experts=8, top_k=3, drop_some=True)
    # one-program align path: 9, 64, 144, 300, 576 entries (sorts of 16 .. 1024 keys); then
    # experts of several blocks (same_experts) and the atomic path (> SMALL_ALIGN_ENTRIES)
    for n, k in ((1, 9), (8, 8), (16, 9), (50, 6), (64, 9)):
        for bm in (16, 64):
            check_moe_align("cpu", n, top_k=k, num_experts=257, block_m=bm, seed=n + bm)
    check_moe_align("cpu", 60, top_k=9, num_experts=257, block_m=16, same_experts=True)
    check_moe_align("cpu", 130, top_k=8, num_experts=40, block_m=16, seed=3)
    check_fused_moe("cpu", f32, 16, hidden=64, inter=32, num_experts=16, top_k=9,
                    drop_some=True)              # 144 entries through the one-program align
    check_fused_moe("cpu", f32, 24, hidden=64, inter=32, num_experts=8, top_k=2,
                    same_experts=True)
    # interior tiles (16 and 8 rows), tiles holding sequence starts, empty and 1-2 token
    # sequences, padding rows, channel tails, widths 2-5 (5: no fast path)
    check_conv_varlen("cpu", f32, [5, 0, 1, 2, 37, 3], dim=40)
    check_conv_varlen("cpu", f32, [2], dim=40, pad_rows=0)
    for width in (4, 3, 2, 5):
        check_conv_varlen("cpu", f32, [5, 0, 1, 2, 37, 3], dim=40, width=width, tiles=(8, 16, 4))
    check_conv_varlen("cpu", f32, [3, 100, 2], dim=40)   # tiles with no sequence start
    check_conv_varlen("cpu", f32, [40], dim=24, pad_rows=0, tiles=(16, 32, 1))
    check_conv_update("cpu", f32, dim=40)
    check_conv_update("cpu", f32, dim=40, width=2)
    # query blocks with and without whole key blocks before the diagonal, a chunk after cached
    # context whose offset is not a block multiple, padded head dims (the tiny preset's rope 8,
    # a v of 24), no rope columns, one row
    check_mla_prefill_attention("cpu", f32, q_len=37, tiles=(16, 16, 4, 2))
    check_mla_prefill_attention("cpu", f32, q_len=21, kv_len=58, tiles=(16, 32, 4, 1))
    check_mla_prefill_attention("cpu", f32, q_len=19, H=2, nope=16, rope=8, v=24,
                                tiles=(16, 16, 4, 1))
    check_mla_prefill_attention("cpu", f32, q_len=9, kv_len=9, H=2, nope=32, rope=0, v=16,
                                tiles=(16, 16, 4, 1))
    check_mla_prefill_attention("cpu", f32, q_len=1, kv_len=40, tiles=(16, 16, 4, 1))
    from kdaserve.kernels.mla import prefill_attn as pa   # the bf16 tiles, for the sm_90 build
    check_mla_prefill_attention("cpu", f32, q_len=3, kv_len=130, H=1, nope=128, rope=64, v=128,
                                tiles=(pa.BLOCK_M, pa.BLOCK_N, pa.NUM_WARPS, pa.NUM_STAGES))
    check_mla_prefill_attention("cpu", f32, q_len=3, kv_len=130, H=1, nope=128, rope=64, v=128,
                                seed=1)         # fp32's default tiles
    check_router("cpu", num_tokens=19, num_experts=64, top_k=6)
    check_router("cpu", num_tokens=5, num_experts=48, top_k=8, renormalize=False, bias=False)


if __name__ == "__main__":
    run_interpreter_suite()
    print("interpreter suite passed")


def capture_graph(step, before_capture=None):
    """Run `step()` once on a side stream (its kernels JIT-compile outside the capture), call
    `before_capture()` if given, then capture `step()` in a CUDA graph. Returns (graph, what
    the captured call returned: the graph's output buffers)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
