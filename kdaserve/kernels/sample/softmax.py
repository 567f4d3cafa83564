"""Row softmax over a vocabulary, split along the row: softmax(logits / T) per row of [B, V],
in two launches of B x S programs (slice statistics, then the normalised write), where
torch's softmax gives each row one program (a few rows of 163840 tokens then leave most SMs
idle). Rows with temperature < 1e-5 get the one-hot of their id instead (a greedy draft's q).

Twin: `softmax_reference` (torch.softmax of the tempered logits, the one-hot rows). Shapes
alone decide the launches (CUDA-graph safe, no host sync).
"""

from __future__ import annotations

import torch

from kdaserve.kernels.sample.race import RACE_BLOCK, RACE_MAX_SPLITS, race_splits
from kdaserve.kernels.utils import check_kernel_device, num_sms, require_triton


def tempered_softmax(logits: torch.Tensor, temperature: torch.Tensor | None = None,
                     ids: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] fp32 with a contiguous last dim (-inf = masked); temperature [B] fp32 or
    None (tempered already); ids [B] int64, needed with temperature: the token of rows with
    T < 1e-5, whose output is its one-hot. Returns q [B, V] fp32 (rows of all -inf: NaN, as
    torch.softmax gives)."""
    _check(logits, temperature, ids)
    B, V = logits.shape
    out = torch.empty(B, V, dtype=torch.float32, device=logits.device)
    if B == 0:
        return out
    require_triton()
    check_kernel_device(logits)
    from kdaserve.kernels.sample.triton_softmax import softmax_stats_kernel, softmax_write_kernel

    S, split_len = race_splits(B, V, num_sms(logits.device))
    stats = torch.empty(B, S, 2, dtype=torch.float32, device=logits.device)
    temp = temperature if temperature is not None else logits
    softmax_stats_kernel[(B, S)](logits, temp, stats, V, split_len, logits.stride(0),
                                 HAS_TEMP=temperature is not None, BLOCK=RACE_BLOCK,
                                 num_warps=4)
    softmax_write_kernel[(B, S)](logits, temp, ids if ids is not None else logits, stats, out,
                                 V, split_len, logits.stride(0), out.stride(0), S,
                                 HAS_TEMP=temperature is not None, HAS_IDS=ids is not None,
                                 BLOCK=RACE_BLOCK, BLOCK_S=RACE_MAX_SPLITS, num_warps=4)
    return out


def softmax_reference(logits: torch.Tensor, temperature: torch.Tensor | None = None,
                      ids: torch.Tensor | None = None) -> torch.Tensor:
    """tempered_softmax's math in torch (fp32)."""
    if temperature is None:
        return torch.softmax(logits, dim=-1)
    greedy = temperature < 1e-5
    q = torch.softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    one = torch.arange(logits.shape[1], device=logits.device)[None, :] == ids[:, None]
    return torch.where(greedy[:, None], one.to(q.dtype), q)


def _check(logits, temperature, ids) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or (
            logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits must be fp32 [B, V] with a contiguous last dim, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    B = logits.shape[0]
    if temperature is not None and (temperature.shape != (B,)
                                    or temperature.dtype != torch.float32
                                    or temperature.device != logits.device):
        raise ValueError(f"temperature must be fp32 [B={B}] on {logits.device}, got "
                         f"{temperature.dtype} {tuple(temperature.shape)}")
    if temperature is not None and (ids is None or ids.shape != (B,)
                                    or ids.dtype != torch.int64 or ids.device != logits.device):
        raise ValueError(f"ids must be int64 [B={B}] on {logits.device} with a temperature "
                         f"(the one-hot of greedy rows), got "
                         f"{None if ids is None else (ids.dtype, tuple(ids.shape))}")


__all__ = ["softmax_reference", "tempered_softmax"]
