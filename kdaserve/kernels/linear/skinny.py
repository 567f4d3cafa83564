"""Projections of 3..64 token rows, y = x @ weight.T, on the tensor cores with each weight
element read once: decode batches of 3-64 requests and the verify windows of small speculative
batches (9 rows a request at K = 8). Above the GEMV's two rows (kernels/linear/gemv.py, CUDA
cores) the step's dense projections are still weight-bound, and cuBLAS's tiles for such M
split K (a second reduce launch) or leave part of the weight stream idle.

One program per BLOCK_N output columns holds all rows (padded to BLOCK_M = 16, 32 or 64, the
smallest MMA tiles) and walks the whole K; no split-K, so the results are deterministic and the
grid depends on shapes only (CUDA-graph safe). Twin: kernels/linear/gemv.py gemv_reference
(F.linear in fp32).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kdaserve.kernels.configs import device_name, load_configs, shape_key
from kdaserve.kernels.linear.gemv import check_linear_inputs
from kdaserve.kernels.utils import cdiv, next_power_of_2, num_sms, pdl_options, require_triton

MIN_M, MAX_M = 3, 64
DTYPES = (torch.bfloat16, torch.float16)
SMEM_BUDGET = 160 * 1024
"""Bytes of shared memory the guessed pipeline may take (sm_90 has 227 KB a block)."""


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int        # output columns (weight rows) per program
    block_k: int        # K elements per step
    num_warps: int
    num_stages: int     # tiles in flight through shared memory
    prefetch: int = 0   # with pdl: the first weight tile loaded before the wait (0 or 1)


def block_m(M: int) -> int:
    """The row tile for M rows: 16, 32 or 64 (one build serves every M of its bucket)."""
    return max(16, next_power_of_2(M))


@functools.cache
def tuned_configs(device_name: str | None, sms: int) -> dict[str, SkinnyConfig]:
    """shape_key(M=block_m(M), N=, K=, dtype=) -> the measured config for that device
    (kernels/configs/skinny_gemm_*.json: the fastest of benchmarks/bench_batch.py's
    `dense` sweep)."""
    return {key: SkinnyConfig(**fields)
            for key, fields in load_configs("skinny_gemm", device_name, sms).items()}


def default_config(M: int, N: int, K: int, dtype: torch.dtype,
                   device: torch.device | None = None) -> SkinnyConfig:
    """The device's measured config for (block_m(M), N, K, dtype) where it has one, else
    guess_config."""
    sms = num_sms(device) if device is not None else 132
    return _default_config(block_m(M), N, K, dtype, device_name(device), sms)


@functools.cache
def _default_config(bm: int, N: int, K: int, dtype: torch.dtype, device_name: str | None,
                    sms: int) -> SkinnyConfig:
    tuned = tuned_configs(device_name, sms).get(shape_key(M=bm, N=N, K=K, dtype=dtype))
    return tuned if tuned is not None else guess_config(bm, N, K, sms)


def guess_config(bm: int, N: int, K: int, sms: int = 132) -> SkinnyConfig:
    """The shape of the tiles the sweeps chose at the 48B's projections (H100, 9-64 rows;
    benchmarks/PERF_NOTES.md): block_n 32 (16 where N gives fewer than `sms` / 2 programs);
    block_k 512 for long K (>= 4096) at up to 32 rows, else 128 (or the next power of two of
    a shorter K, at least 32); stages: as many as SMEM_BUDGET holds of the (bm + block_n) x
    block_k bf16 tiles, 2..5; 4 warps."""
    block_n = 32 if cdiv(N, 32) >= sms // 2 else 16
    block_k = (512 if K >= 4096 and bm <= 32 else 128) if K >= 128 else max(32, next_power_of_2(K))
    stage = (bm + block_n) * block_k * 2
    stages = max(2, min(5, SMEM_BUDGET // stage))
    return SkinnyConfig(block_n=block_n, block_k=block_k, num_warps=4, num_stages=stages)


def check_config(config: SkinnyConfig) -> None:
    for name, value, lo, hi in (("block_n", config.block_n, 16, 256),
                                ("block_k", config.block_k, 16, 1024),
                                ("num_warps", config.num_warps, 1, 16)):
        if not lo <= value <= hi or value & (value - 1):
            raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {value}")
    if config.num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {config.num_stages}")
    if config.prefetch not in (0, 1):
        raise ValueError(f"prefetch must be 0 or 1, got {config.prefetch}")


def _check_inputs(x, weight, out, out_dtype) -> torch.dtype:
    """gemv's operand checks at 3..64 rows, and x and weight of one 16-bit dtype (the MMA's
    operands); returns the output dtype."""
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a dtype in {DTYPES}, got {x.dtype} and "
                         f"{weight.dtype}")
    return check_linear_inputs(x, weight, out, out_dtype, (MIN_M, MAX_M), "skinny_gemm",
                               "gemv below, F.linear above")


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, config: SkinnyConfig | None = None,
                pdl: bool = False) -> torch.Tensor:
    """y = x @ weight.T with fp32 accumulation.

    x: [M, K], 3 <= M <= 64, bf16 / fp16, last dim contiguous (rows may be strided); weight:
    [N, K] of x's dtype, last dim contiguous. out: [M, N] (last dim contiguous, may be a
    row-strided view) or None; its dtype is out.dtype, else out_dtype, else x.dtype (fp32
    allowed). pdl: launch with programmatic dependent launch (sm_90+ on CUDA; ignored for CPU
    tensors under the Triton interpreter, which keep only config.prefetch's load order), the
    first config.prefetch weight tiles read before the wait. Returns out."""
    if config is not None:
        check_config(config)
    dtype = _check_inputs(x, weight, out, out_dtype)
    M, K = x.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=dtype, device=x.device)
    if N == 0:
        return out
    require_triton()
    from kdaserve.kernels.linear.triton_skinny import skinny_gemm_kernel

    cfg = config or default_config(M, N, K, weight.dtype, x.device)
    skinny_gemm_kernel[(cdiv(N, cfg.block_n),)](
        x, weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m(M), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=K % cfg.block_k == 0, STAGES=cfg.num_stages, PREFETCH=cfg.prefetch if pdl else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(pdl, x))
    return out


__all__ = ["MAX_M", "MIN_M", "SkinnyConfig", "block_m", "check_config", "default_config",
           "guess_config", "skinny_gemm", "tuned_configs"]
