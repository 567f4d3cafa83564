"""Weight merging done once after loading: projections that read the same input become one
GEMM. The original parameters become views into the merged tensor, so no memory is duplicated
and their names still address the same values."""

from __future__ import annotations

import torch
from torch import nn


def merge_rows(*params: nn.Parameter, extra_rows: int = 0) -> torch.Tensor:
    """Concatenate parameters along dim 0 (plus `extra_rows` zero rows at the end); each
    parameter's data becomes a view of its rows. Returns the merged tensor."""
    rows = sum(p.shape[0] for p in params) + extra_rows
    merged = params[0].new_zeros(rows, *params[0].shape[1:])
    off = 0
    for p in params:
        n = p.shape[0]
        merged[off:off + n].copy_(p.data)
        p.data = merged[off:off + n]
        off += n
    return merged
