"""Absorbed paged MLA decode (split-K flash-decoding) and the latent-KV store, on Triton.

Same contracts as `kdaserve.kernels.reference.mla_decode` / `store_kv`. Both are CUDA-graph safe:
no host syncs, and the launch grid depends only on tensor shapes (batch size, block-table width)
and the optional `num_kv_splits`, never on the values of `seq_lens`.

`pdl=True` launches every kernel with programmatic dependent launch (sm_90+): a kernel may start
while the previous one in the stream finishes and waits for it (griddepcontrol.wait) before it
reads anything a kernel writes or stores anything (store_latent reads its norm weight before the
wait, so the previous kernel must not write it), then lets the next PDL kernel start. Same
results as pdl=False; ignored on CPU tensors (the Triton interpreter cannot run the PTX).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.kernels.utils import (cdiv, check_kernel_device, next_power_of_2, num_sms,
                                    pdl_options, require_triton)

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class MLADecodeConfig:
    block_h: int        # heads per program (all heads of a sequence when it is >= num_heads)
    block_n: int        # context rows per inner step
    num_warps: int
    num_stages: int
    transposed: bool = False   # tokens/channels as MMA rows (warpgroup MMA on Hopper)
    rows: int = 1   # query rows of one sequence per program (transposed; mla_decode rows_per_seq)


def default_config(batch: int, num_heads: int, dtype: torch.dtype) -> MLADecodeConfig:
    """Size classes by batch: the bf16 tiles are the fastest of bench_layers.py --tune (batch 1)
    and bench_batch.py (batch 16, 32, 64: the transposed tiles, with about one wave of
    programs, see choose_num_kv_splits) at 32 heads and 8K context (benchmarks/PERF_NOTES.md);
    fp32 (tests, interpreter) takes small tiles."""
    block_h = min(32, max(16, next_power_of_2(num_heads)))
    if dtype == torch.float32:
        return MLADecodeConfig(block_h=min(block_h, 16), block_n=16, num_warps=4, num_stages=1)
    if batch <= 4:
        return MLADecodeConfig(block_h=block_h, block_n=64, num_warps=8, num_stages=2)
    return MLADecodeConfig(block_h=block_h, block_n=64, num_warps=4, num_stages=3,
                           transposed=True)


def fold_config(num_heads: int, dtype: torch.dtype) -> MLADecodeConfig:
    """The fold kernel's tiles for verify windows (mla_decode rows_per_seq > 1): 2 rows of a
    window x up to 32 heads as one program's columns, 64 context rows a step, 8 warps (4 warps
    spill several times more in ptxas's sm_90 build; 32 context rows were no faster in
    bench_batch.py --mla-rows-per-seq 9); fp32 (tests, interpreter) small tiles."""
    block_h = min(32, max(16, next_power_of_2(num_heads)))
    if dtype == torch.float32:
        return MLADecodeConfig(min(block_h, 16), 16, 4, 1, transposed=True, rows=2)
    return MLADecodeConfig(block_h, 64, 8, 2, transposed=True, rows=2)


def choose_num_kv_splits(batch: int, num_head_groups: int, max_context: int,
                         device: torch.device, min_tokens_per_split: int = 64,
                         max_splits: int = 128, waves: int = 2) -> int:
    """Enough (b, split, head group) programs for ~`waves` waves, each partition >=
    min_tokens_per_split. Two waves suit the small tiles of batches <= 4; the transposed tiles
    of larger batches take one wave rounded down to a power of two (bench_batch.py: at 16 / 32 /
    64 sequences, 8 / 4 / 2 splits were the fastest).

    Depends only on shapes, so a captured CUDA graph keeps its grid.
    """
    cap = max(1, max_context // min_tokens_per_split)
    if waves == 1:
        # a power of two at most one wave: partitions that are not a multiple of the tiles
        # (5 or 3 splits at 32 / 64 sequences) are slower (benchmarks/PERF_NOTES.md)
        want = max(1, num_sms(device) // max(1, batch * num_head_groups))
        want = 1 << (want.bit_length() - 1)
    else:
        want = cdiv(waves * num_sms(device), max(1, batch * num_head_groups))
    return max(1, min(want, cap, max_splits))


def window_num_kv_splits(num_seqs: int, num_head_groups: int, max_context: int,
                         device: torch.device) -> int:
    """Context partitions of verify windows (mla_decode rows_per_seq > 1): a window's rows read
    the same keys, so the partitions follow the sequences, not the rows: about one wave of
    (sequence, partition, head group) programs, a power of two, >= 256 keys each
    (bench_batch.py --mla-rows-per-seq 9: at 8 / 16 / 32 windows of 9 rows and 8K context,
    16 / 8 / 4 splits were the fastest). Shapes only, so a captured graph keeps its grid."""
    n = choose_num_kv_splits(num_seqs, num_head_groups, max_context, device,
                             min_tokens_per_split=256, waves=1)
    return 1 << (n.bit_length() - 1)


def _check_mla_inputs(q, kv_cache, block_table, seq_lens, kv_lora_rank, rope=None):
    """rope: the separate q_pe's width (q then holds only the latent part)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, kv_lora_rank + rope], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, D], got {tuple(kv_cache.shape)}")
    width = q.shape[-1] + (rope or 0)
    if width != kv_cache.shape[-1]:
        raise ValueError(f"q last dim {width} != kv_cache last dim {kv_cache.shape[-1]}")
    if not 0 < kv_lora_rank <= width:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} out of range for D={width}")
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} != kv_cache dtype {kv_cache.dtype}")
    page = kv_cache.shape[1]
    if page < 1 or page & (page - 1):
        raise ValueError(f"block_size must be a power of two, got {page}")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0]:
        raise ValueError(f"block_table must be [B={q.shape[0]}, max_blocks], "
                         f"got {tuple(block_table.shape)}")
    if seq_lens.shape != (q.shape[0],):
        raise ValueError(f"seq_lens must be [B={q.shape[0]}], got {tuple(seq_lens.shape)}")
    if kv_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and kv_cache need a contiguous last dim")
    if block_table.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"block_table/seq_lens must be int32/int64, got "
                         f"{block_table.dtype}/{seq_lens.dtype}")
    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_table", block_table),
                    ("seq_lens", seq_lens)):
        check_kernel_device(t)
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, kv_lora_rank: int,
               out: torch.Tensor | None = None, num_kv_splits: int | None = None,
               max_seq_len: int | None = None,
               config: MLADecodeConfig | None = None,
               q_pe: torch.Tensor | None = None, pdl: bool = False,
               prefetch_kv: bool = False, return_lse: bool = False, rows_per_seq: int = 1):
    """Absorbed MLA decode, one query token per row.

    q: [B, H, kv_lora_rank + rope] (q_nope already multiplied by W_UK) -- or, with q_pe
    [B, H, rope] given, q holds only the [B, H, kv_lora_rank] latent part (two strided inputs,
    no concatenation);
    kv_cache: [num_blocks, block_size, kv_lora_rank + rope], block_size a power of two;
    block_table: [B, max_blocks] int32; seq_lens: [B] int32 (0 = padding row -> zeros).
    Returns the latent output [B, H, kv_lora_rank] in q.dtype (into `out` when given); with
    return_lse, (out, lse): lse [B, H] fp32 is each query's natural-log log-sum-exp over its
    seq_lens[b] keys (-inf when empty), the reduce kernel's merge of its partitions, so outputs
    over disjoint key sets (decode context parallelism) merge exactly (merge.py).

    num_kv_splits: context partitions per sequence; default from the shapes (batch size and
    max_seq_len, which defaults to max_blocks * block_size), so CUDA-graph replays keep one grid.
    rows_per_seq > 1: every run of that many rows is one sequence's verify window (equal block
    table rows); the default split count then follows the sequences (window_num_kv_splits).
    With config.rows > 1 (fold_config) a program also takes that many rows of a window as its
    MMA columns.
    pdl: both launches (partial, reduce) with programmatic dependent launch (module docstring).
    prefetch_kv (with pdl; not with config.transposed): the partial kernel reads seq_lens, the
    block table and its partition's first cache tile before griddepcontrol.wait, so the
    kernel launched just before this call must not write them (store_latent must not be the
    previous launch). Same results.
    """
    require_triton()
    if q_pe is not None:
        if q_pe.dim() != 3 or q_pe.shape[:2] != q.shape[:2] or q.shape[-1] != kv_lora_rank \
                or q_pe.stride(-1) != 1:
            raise ValueError(f"with q_pe, q must be [B, H, kv_lora_rank={kv_lora_rank}] and q_pe "
                             f"[B, H, rope] with a contiguous last dim; got {tuple(q.shape)} and "
                             f"{tuple(q_pe.shape)}")
        if q_pe.dtype != q.dtype:
            raise ValueError(f"q and q_pe dtypes differ: {q.dtype}, {q_pe.dtype}")
    rope_dim = q_pe.shape[-1] if q_pe is not None else None
    _check_mla_inputs(q, kv_cache, block_table, seq_lens, kv_lora_rank, rope_dim)
    from kdaserve.kernels.mla.triton_decode import (mla_decode_partial_fold_kernel,
                                                    mla_decode_partial_kernel,
                                                    mla_decode_partial_t_kernel,
                                                    mla_decode_reduce_kernel)

    B, H = q.shape[:2]
    rope = kv_cache.shape[-1] - kv_lora_rank
    if q_pe is None:
        q_pe = q[..., kv_lora_rank:]                                  # [B, H, rope] view
    page = kv_cache.shape[1]
    cfg = config or default_config(B, H, q.dtype)
    if cfg.block_h < 16 and q.device.type == "cuda":
        raise ValueError(f"block_h must be >= 16 on GPU (tl.dot), got {cfg.block_h}")
    head_groups = cdiv(H, cfg.block_h)
    fold = cfg.rows > 1
    if fold and (not cfg.transposed or cfg.rows & (cfg.rows - 1)):
        raise ValueError(f"config.rows > 1 needs transposed tiles and a power of two, got "
                         f"{cfg}")
    if rows_per_seq < 1 or B % rows_per_seq:
        raise ValueError(f"rows_per_seq must be >= 1 and divide the {B} rows, got "
                         f"{rows_per_seq}")
    if max_seq_len is None:
        max_seq_len = block_table.shape[1] * page
    if num_kv_splits is None:
        if rows_per_seq > 1:
            num_kv_splits = window_num_kv_splits(B // rows_per_seq, head_groups, max_seq_len,
                                                 q.device)
        else:
            num_kv_splits = choose_num_kv_splits(B, head_groups, max_seq_len, q.device,
                                                 waves=1 if cfg.transposed else 2)
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if out is None:
        out = torch.empty(B, H, kv_lora_rank, dtype=q.dtype, device=q.device)
    elif out.shape != (B, H, kv_lora_rank) or out.stride(-1) != 1:
        raise ValueError(f"out must be [B, H, kv_lora_rank]={B, H, kv_lora_rank} with a contiguous "
                         f"last dim, got {tuple(out.shape)}")
    lse = torch.empty(B, H, dtype=torch.float32, device=q.device) if return_lse else None
    if B == 0:
        return (out, lse) if return_lse else out

    # [B, H, num_splits, kv_lora_rank] fp32 partial outputs; [B, H, num_splits] base-2 lse
    part_out = torch.empty(B, H, num_kv_splits, kv_lora_rank, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, H, num_kv_splits, dtype=torch.float32, device=q.device)
    block_c = next_power_of_2(kv_lora_rank)
    block_r = max(16, next_power_of_2(rope)) if rope > 0 else 1   # tl.dot needs K >= 16
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    pdl_opts = pdl_options(pdl, q)
    args = (q, q_pe, kv_cache, block_table, seq_lens, part_out, part_lse, float(scale) * LOG2E,
            q.stride(0), q.stride(1), q_pe.stride(0), q_pe.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), H, num_kv_splits)
    consts = dict(KV_RANK=kv_lora_rank, ROPE=rope, BLOCK_C=block_c, BLOCK_R=block_r,
                  PAGE_SIZE=page, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
                  DOT_PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  **pdl_opts)
    if fold:   # one program per config.rows rows of a window
        row_groups = (B // rows_per_seq) * cdiv(rows_per_seq, cfg.rows)
        mla_decode_partial_fold_kernel[(row_groups, num_kv_splits, head_groups)](
            *args, rows_per_seq, B, ROWS=cfg.rows, **consts)
    elif cfg.transposed:
        mla_decode_partial_t_kernel[(B, num_kv_splits, head_groups)](*args, **consts)
    else:
        mla_decode_partial_kernel[(B, num_kv_splits, head_groups)](
            *args, PREFETCH_KV=bool(prefetch_kv), **consts)
    block_s = max(16, next_power_of_2(num_kv_splits))           # few variants (<= 4)
    block_c_red = min(block_c, max(16, 4096 // block_s))          # <= 4K partials per program
    lse_arg = lse if return_lse else part_lse                   # never written without lse
    mla_decode_reduce_kernel[(B, H, cdiv(kv_lora_rank, block_c_red))](
        part_out, part_lse, out, lse_arg,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse_arg.stride(0),
        num_kv_splits,
        KV_RANK=kv_lora_rank, BLOCK_C=block_c_red, BLOCK_S=block_s, num_warps=4,
        STORE_LSE=return_lse, **pdl_opts,
    )
    return (out, lse) if return_lse else out


def store_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor,
             pdl: bool = False) -> None:
    """kv_cache.view(-1, D)[slot_mapping] = kv, in place; slots < 0 are skipped (padding).

    kv_cache: [num_blocks, block_size, D] contiguous; slot_mapping: [T] int; kv: [T, D].
    pdl: programmatic dependent launch (module docstring).
    """
    require_triton()
    from kdaserve.kernels.mla.triton_decode import store_kv_kernel

    if kv_cache.dim() != 3 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be a contiguous [num_blocks, block_size, D], got "
                         f"shape {tuple(kv_cache.shape)}")
    D = kv_cache.shape[-1]
    if kv.dim() != 2 or kv.shape[1] != D or kv.stride(1) != 1:
        raise ValueError(f"kv must be [T, {D}] with a contiguous last dim, got {tuple(kv.shape)}")
    if slot_mapping.shape != (kv.shape[0],):
        raise ValueError(f"slot_mapping must be [T={kv.shape[0]}], got {tuple(slot_mapping.shape)}")
    for t in (kv_cache, slot_mapping, kv):
        check_kernel_device(t)
    if kv.shape[0] == 0:
        return
    pdl_opts = pdl_options(pdl, kv)
    store_kv_kernel[(kv.shape[0],)](kv_cache, slot_mapping, kv, kv.stride(0), D,
                                    BLOCK_D=next_power_of_2(D), num_warps=4,
                                    **pdl_opts)


def store_latent(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, ckv: torch.Tensor,
                 norm_weight: torch.Tensor, eps: float, pdl: bool = False) -> None:
    """Twin of reference.store_latent in one launch: RMS-norm the first rank = norm_weight
    channels of each ckv row [T, rank + rope] and write the row into its slot (< 0 skipped).
    ckv may be a row-strided view (the q|kv_a projection's output). pdl: programmatic
    dependent launch (module docstring; norm_weight is read before the wait)."""
    require_triton()
    from kdaserve.kernels.mla.triton_decode import store_latent_kernel

    if kv_cache.dim() != 3 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be a contiguous [num_blocks, block_size, D], got "
                         f"shape {tuple(kv_cache.shape)}")
    D, rank = kv_cache.shape[-1], norm_weight.shape[0]
    if ckv.dim() != 2 or ckv.shape[1] != D or ckv.stride(1) != 1:
        raise ValueError(f"ckv must be [T, {D}] with a contiguous last dim, got "
                         f"{tuple(ckv.shape)}")
    if norm_weight.dim() != 1 or not 0 < rank <= D:
        raise ValueError(f"norm_weight must be [rank] with rank <= {D}, got "
                         f"{tuple(norm_weight.shape)}")
    if slot_mapping.shape != (ckv.shape[0],):
        raise ValueError(f"slot_mapping must be [T={ckv.shape[0]}], got "
                         f"{tuple(slot_mapping.shape)}")
    for t in (kv_cache, slot_mapping, ckv, norm_weight):
        check_kernel_device(t)
    if ckv.shape[0] == 0:
        return
    pdl_opts = pdl_options(pdl, ckv)
    store_latent_kernel[(ckv.shape[0],)](kv_cache, slot_mapping, ckv, norm_weight, ckv.stride(0),
                                         D, rank, float(eps), BLOCK_D=next_power_of_2(D),
                                         num_warps=4,
                                         **pdl_opts)
