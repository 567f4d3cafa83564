"""AttnRes (Kimi K3): softmax attention over depth in place of the residual stream.

The layers are grouped in blocks of attn_res_block_size (B). Per token the model keeps `blocks`
[T, NB, D] (block 0 = the embedding, block j = the sum of all sublayer outputs of layers
(j-1)B .. jB-1) and `prefix` [T, D], the running sum of the current block. Before each sublayer
(attention, MLP) one read mixes the finished blocks and the prefix by a softmax whose logits are
a learned per-sublayer query against the RMS-normed sources (kernels/reference.py attn_res),
then applies the sublayer's input norm. Layer i with i % B == 0 starts a block: its first read
writes the finished prefix to blocks[i // B], and its attention output restarts the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kdaserve.kernels import reference as ref
from kdaserve.layers.norm import RMSNorm


@dataclass
class DepthState:
    """The per-token depth memory of one forward pass."""

    prefix: torch.Tensor
    """[T, D] the running sum of the current block."""
    blocks: torch.Tensor
    """[T, NB, D] the finished blocks."""

    @classmethod
    def start(cls, embeddings: torch.Tensor, num_blocks: int) -> "DepthState":
        """embeddings: [T, D] -> prefix = embeddings, blocks zero (block 0 is written by
        layer 0's first read)."""
        T, D = embeddings.shape
        return cls(embeddings, embeddings.new_zeros(T, num_blocks, D))


def attn_res_read(state: DepthState, delta: torch.Tensor | None, res_norm: RMSNorm,
                  res_proj: nn.Linear, out_norm: RMSNorm | None, num_blocks: int,
                  write_idx: int = -1, kernel: bool = False, pdl: bool = False
                  ) -> torch.Tensor:
    """One read point: adds delta ([T, D] or None) to the prefix, writes blocks[write_idx] if
    >= 0, and returns the mixture of blocks[:num_blocks] and the prefix (logits from
    res_proj's query row against RMSNorm(source; res_norm)), normed by out_norm when given.
    [T, D]. The parameters live in the caller under the checkpoint's names
    (`self_attention_res_norm`, `mlp_res_proj`, ...). kernel: the caller's attn_res backend is
    triton (layers/backends.py): the read is one launch (kernels/attn_res; pdl: launched with
    programmatic dependent launch), else the reference twin's torch ops."""
    args = (state.prefix, delta, state.blocks, res_norm.weight, res_proj.weight[0],
            None if out_norm is None else out_norm.weight, num_blocks, write_idx, res_norm.eps)
    if kernel:
        from kdaserve.kernels.attn_res.attn_res import attn_res

        state.prefix, out = attn_res(*args, pdl=pdl)
    else:
        state.prefix, out = ref.attn_res(*args)
    return out
