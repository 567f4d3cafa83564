"""Allocation and sizing of the model caches: paged MLA latent KV + KDA state slots.

Under tensor parallelism (tp_size > 1) each rank holds the state of its linear_num_heads / tp
KDA heads; the MLA latent KV is replicated (every rank holds all of it)."""

from __future__ import annotations

import torch

from kdaserve.attention.metadata import ModelCaches
from kdaserve.config.model_args import KimiLinearArgs


def kv_bytes_per_block(args: KimiLinearArgs, block_size: int, dtype: torch.dtype) -> int:
    """Latent-KV bytes of one block over all MLA layers."""
    elt = torch.empty((), dtype=dtype).element_size()
    return len(args.mla_layer_ids) * block_size * args.kv_cache_dim * elt


def state_bytes_per_slot(args: KimiLinearArgs, dtype: torch.dtype, tp_size: int = 1) -> int:
    """KDA bytes of one slot over all KDA layers: fp32 recurrent [H, K, V] + conv window (one
    rank's heads)."""
    elt = torch.empty((), dtype=dtype).element_size()
    h, d, w = args.linear_num_heads // tp_size, args.linear_head_dim, args.linear_conv_kernel_dim
    per_layer = h * d * d * 4 + 3 * h * d * (w - 1) * elt
    return len(args.kda_layer_ids) * per_layer


def allocate_caches(args: KimiLinearArgs, num_blocks: int, block_size: int, num_slots: int,
                    dtype: torch.dtype, device: torch.device | str,
                    tp_size: int = 1) -> ModelCaches:
    """MLA latent KV [num_blocks, block_size, rank + rope] per MLA layer; KDA recurrent
    [num_slots, H / tp, K, V] fp32 and conv [num_slots, 3 H / tp K, W - 1] per KDA layer."""
    h, d, w = args.linear_num_heads // tp_size, args.linear_head_dim, args.linear_conv_kernel_dim
    mla = [torch.zeros(num_blocks, block_size, args.kv_cache_dim, dtype=dtype, device=device)
           for _ in args.mla_layer_ids]
    rec = [torch.zeros(num_slots, h, d, d, dtype=torch.float32, device=device)
           for _ in args.kda_layer_ids]
    conv = [torch.zeros(num_slots, 3 * h * d, w - 1, dtype=dtype, device=device)
            for _ in args.kda_layer_ids]
    return ModelCaches(mla_kv=mla, kda_recurrent=rec, kda_conv=conv)
