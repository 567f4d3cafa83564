"""Decode-size linear layer y = x @ weight.T for M = 1..4 rows, on Triton (CUDA cores, fp32 acc).

Twin: `gemv_reference` below (F.linear in fp32, cast to the output dtype). No split-K and no
atomics: the grid covers N only, so results are deterministic and the launch is CUDA-graph safe
(the grid depends on shapes only). x and weight may differ in dtype (bf16 x with the MoE router's
fp32 weight is read as is: no conversion launch).

`pdl=True` launches with programmatic dependent launch (Hopper+): the kernel starts while the
previous kernel in the stream finishes, loads its first `config.prefetch` weight tiles, then waits
(griddepcontrol.wait) for that kernel's writes before it reads x or writes out. Same results as
pdl=False (same reduction order). The overlap needs a PDL-aware previous kernel (one that calls
griddepcontrol.launch_dependents, as this one does right after its wait); after any other kernel
the launch starts when that kernel completes, as without pdl.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kdaserve.kernels.configs import device_name, load_configs, shape_key
from kdaserve.kernels.utils import (cdiv, check_kernel_device, next_power_of_2, num_sms,
                                    pdl_options, require_triton)

MAX_M = 4
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PREFETCH_TILES = (0, 1, 2)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int        # output columns (weight rows) per program
    block_k: int        # K elements per loop step
    num_warps: int
    num_stages: int     # software pipelining depth of the K loop (tiles in flight)
    prefetch: int = 2   # with pdl: weight tiles (BLOCK_K steps) loaded before the wait, 0..2


@functools.cache
def tuned_configs(device_name: str | None, sms: int) -> dict[str, GemvConfig]:
    """shape_key(M=, N=, K=, dtype=weight dtype) -> the measured config for that device
    (kernels/configs/gemv_*.json: the fastest of benchmarks/bench_chain.py's sweep, pdl calls
    back to back on distinct weights, at the Kimi-Linear-48B decode shapes)."""
    return {key: GemvConfig(**fields)
            for key, fields in load_configs("gemv", device_name, sms).items()}


def default_config(M: int, N: int, K: int, weight_dtype: torch.dtype,
                   device: torch.device | None = None) -> GemvConfig:
    """The device's measured config for the shape (tuned_configs) where it has one, else a
    guess, measured only at some shapes (benchmarks/bench_chain.py and bench_gemv.py --tune
    measure it). Without a device: no device name and 132 SMs (as for CPU tensors).

    block_n: the largest power of two <= 64 that still gives >= 2 waves of programs on the
    device's SMs; block_k: the largest of 512/256/128 that divides K (no K mask), else
    min(256, next_power_of_2(K)); num_warps: about two 16-byte loads per thread per step, 1..8;
    prefetch (used with pdl only): 2 tiles (measured clearly faster than 1 at the KDA input
    projection and slightly slower at o_proj, M = 1; benchmarks/PERF_NOTES.md).
    M does not enter the guess yet.
    """
    sms = num_sms(device) if device is not None else 132
    return _default_config(M, N, K, weight_dtype, device_name(device), sms)


@functools.cache
def _default_config(M: int, N: int, K: int, weight_dtype: torch.dtype, device_name: str | None,
                    sms: int) -> GemvConfig:
    """default_config once per shape and device: a launch then costs a dict lookup."""
    tuned = tuned_configs(device_name, sms).get(shape_key(M=M, N=N, K=K, dtype=weight_dtype))
    return tuned if tuned is not None else guess_config(N, K, weight_dtype, sms)


def guess_config(N: int, K: int, weight_dtype: torch.dtype, sms: int = 132) -> GemvConfig:
    """default_config's rule where no measured config applies (see there)."""
    block_n = 64
    while block_n > 1 and cdiv(N, block_n) < 2 * sms:
        block_n //= 2
    block_k = next((b for b in (512, 256, 128) if K % b == 0 and K >= b),
                   min(256, next_power_of_2(K)))
    vec = 16 // torch.empty((), dtype=weight_dtype).element_size()   # elements per 16 B load
    loads = max(1, block_n * block_k // (32 * vec * 2))              # warps for 2 loads/thread
    num_warps = min(8, 1 << (loads.bit_length() - 1))                # a power of two <= loads
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=3)


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    """x: [M, 2K] = [gate | up] -> silu(gate) * up in fp32 (fp64 stays fp64), rounded to
    x.dtype: [M, K]."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    gate, up = x.to(acc).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def situ_reference(x: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """x: [M, 2K] = [gate | up] -> Kimi K3's SiTU(gate, up) in fp32 (fp64 stays fp64), rounded
    to x.dtype: [M, K] (kernels/reference.py situ_and_mul)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    gate, up = x.to(acc).chunk(2, dim=-1)
    g = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return (g * up).to(x.dtype)


def gemv_reference(x: torch.Tensor, weight: torch.Tensor,
                   out_dtype: torch.dtype | None = None, swiglu: bool = False,
                   situ: tuple[float, float | None] | None = None) -> torch.Tensor:
    """F.linear(x.float(), weight.float()) cast to out_dtype (default x.dtype): [M, N]; with
    swiglu, x is [M, 2K] and swiglu_reference(x) takes its place; with situ = (beta,
    linear_beta), x is [M, 2K] and situ_reference(x, *situ) takes its place.

    fp64 inputs stay fp64 (the checks use that to keep TF32 out of the reference)."""
    if situ is not None:
        x = situ_reference(x, *situ)
    elif swiglu:
        x = swiglu_reference(x)
    acc = torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32
    y = torch.nn.functional.linear(x.to(acc), weight.to(acc))     # [M, N]
    return y.to(out_dtype or x.dtype)


def _check_pow2(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi or value & (value - 1):
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {value}")


def check_config(config: GemvConfig) -> None:
    _check_pow2("block_n", config.block_n, 1, 1024)
    _check_pow2("block_k", config.block_k, 1, 8192)
    _check_pow2("num_warps", config.num_warps, 1, 32)
    if config.num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {config.num_stages}")
    if config.prefetch not in PREFETCH_TILES:
        raise ValueError(f"prefetch must be one of {PREFETCH_TILES}, got {config.prefetch}")


def _check_last_dim(name: str, t: torch.Tensor) -> None:
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")


def check_linear_inputs(x, weight, out, out_dtype, rows: tuple[int, int] = (1, MAX_M),
                        kernel: str = "gemv", beyond: str = "use F.linear") -> torch.dtype:
    """Validate a projection kernel's operands before any launch (x [M, K] with rows[0] <= M <=
    rows[1], weight [N, K], out [M, N] or None; dtypes in DTYPES, contiguous last dims, one
    device); returns the output dtype. kernel / beyond name the kernel and the way out in the
    row-count error."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    M, K = x.shape
    N = weight.shape[0]
    if not rows[0] <= M <= rows[1]:
        raise ValueError(f"{kernel} takes {rows[0]} <= M <= {rows[1]} rows, got M={M} "
                         f"({beyond})")
    if weight.shape[1] != K:
        raise ValueError(f"x K={K} != weight K={weight.shape[1]}")
    _check_last_dim("x", x)
    _check_last_dim("weight", weight)
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} not in {DTYPES}")
    dtype = out_dtype or x.dtype
    if out is not None:
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out dtype {out.dtype} != out_dtype {out_dtype}")
        if out.dim() != 2 or tuple(out.shape) != (M, N):
            raise ValueError(f"out must be [M={M}, N={N}], got {tuple(out.shape)}")
        _check_last_dim("out", out)
        dtype = out.dtype
    if dtype not in DTYPES:
        raise ValueError(f"out dtype {dtype} not in {DTYPES}")
    for name, t in (("weight", weight), ("out", out)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    check_kernel_device(x)
    return dtype


def gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, config: GemvConfig | None = None,
         pdl: bool = False, swiglu: bool = False,
         situ: tuple[float, float | None] | None = None) -> torch.Tensor:
    """y = x @ weight.T with fp32 accumulation.

    x: [M, K], 1 <= M <= 4, bf16/fp16/fp32, last dim contiguous (rows may be strided).
    weight: [N, K], bf16/fp16/fp32, last dim contiguous. out: [M, N] (last dim contiguous, may
    be a row-strided view) or None; its dtype is out.dtype, else out_dtype, else x.dtype.
    pdl: launch with programmatic dependent launch and prefetch min(config.prefetch, K steps)
    weight tiles before griddepcontrol.wait (see the module docstring); needs sm_90+ on CUDA.
    On CPU tensors (the Triton interpreter, which cannot run the PTX) only the prefetch order
    is kept. weight is read before the wait, so the previous kernel must not write it. Results
    are the same as with pdl=False. Returns out ([M, N]).
    swiglu: x is [M, 2K] = [gate | up] (a SwiGLU MLP's gate/up projection) and the product
    reads silu(gate) * up, rounded to x.dtype, in place of x (gemv_reference(swiglu=True)).
    situ: (beta, linear_beta): as swiglu with Kimi K3's SiTU in place of silu(gate) * up
    (gemv_reference(situ=...)); both are constants of the model (each pair compiles once).
    """
    if config is not None:
        check_config(config)
    if situ is not None:
        swiglu = True
    if swiglu:
        if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != 2 * weight.shape[1]:
            raise ValueError(f"swiglu: x must be [M, 2K] for weight [N, K], got "
                             f"{tuple(x.shape)} and {tuple(weight.shape)}")
        x = x[:, :weight.shape[1]]       # the gate half; the kernel reads up at +K
    dtype = check_linear_inputs(x, weight, out, out_dtype)
    M, K = x.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=dtype, device=x.device)
    if N == 0:
        return out
    cfg = config or default_config(M, N, K, weight.dtype, x.device)
    _launch(x, weight, out, cfg, pdl, batch=1, batch_strides=(0, 0, 0), swiglu=swiglu,
            situ=situ)
    return out


def gemv_batched(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, config: GemvConfig | None = None,
                 pdl: bool = False) -> torch.Tensor:
    """out[b] = x[b] @ weight[b].T for every b in one launch (e.g. MLA's per-head W_UK / W_UV
    products at decode, b = head).

    x: [B, M, K] (1 <= M <= 4; any strides with a contiguous last dim, e.g. a transposed
    [M, B, K] view); weight: [B, N, K]; out: [B, M, N] (any strides, contiguous last dim) or
    None (a new [B, M, N]). Each batch entry is what gemv(x[b], weight[b]) computes (same
    checks, same reduction order). config: default_config(M, B * N, K, ...) when None (the
    grid is B x cdiv(N, block_n)). Returns out."""
    if config is not None:
        check_config(config)
    if x.dim() != 3 or weight.dim() != 3 or x.shape[0] != weight.shape[0]:
        raise ValueError(f"x must be [B, M, K] and weight [B, N, K] with the same B, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    B, M, K = x.shape
    N = weight.shape[1]
    if out is not None and (out.dim() != 3 or out.shape[0] != B):
        raise ValueError(f"out must be [B={B}, M={M}, N={N}], got {tuple(out.shape)}")
    if B == 0:
        raise ValueError("gemv_batched needs B >= 1")
    dtype = check_linear_inputs(x[0], weight[0], None if out is None else out[0],
                                out_dtype)
    if out is None:
        out = torch.empty(B, M, N, dtype=dtype, device=x.device)
    if N == 0:
        return out
    cfg = config or default_config(M, B * N, K, weight.dtype, x.device)
    _launch(x[0], weight[0], out[0], cfg, pdl, batch=B,
            batch_strides=(x.stride(0), weight.stride(0), out.stride(0)))
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: GemvConfig,
            pdl: bool, batch: int, batch_strides: tuple[int, int, int],
            swiglu: bool = False, situ: tuple[float, float | None] | None = None) -> None:
    """gemv_kernel over (cdiv(N, block_n), batch) programs; x / weight / out are batch entry 0
    ([M, K] / [N, K] / [M, N]) and batch_strides step to the next entry of each."""
    require_triton()
    from kdaserve.kernels.linear.triton_gemv import gemv_kernel

    M, K = x.shape
    N = weight.shape[0]
    prefetch = min(cfg.prefetch, cdiv(K, cfg.block_k)) if pdl else 0
    gemv_kernel[(cdiv(N, cfg.block_n), batch)](
        x, weight, out, N, K, x.stride(0), weight.stride(0), out.stride(0), *batch_strides,
        M=M, BLOCK_M=next_power_of_2(M), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=K % cfg.block_k == 0, PREFETCH=prefetch, STAGES=cfg.num_stages, SWIGLU=swiglu,
        **({} if situ is None else dict(SITU=True, SITU_BETA=float(situ[0]),
                                        SITU_LINEAR_BETA=float(situ[1] or 0.0))),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(pdl, x))
