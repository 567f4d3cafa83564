"""Tensor-parallel building blocks: how a parameter is split across the ranks, column- and
row-parallel linears, the vocabulary-parallel embedding and LM head.

Each rank holds exactly its slice of the full model's tensors (the loader cuts them with
`shard`, for checkpoints and dummy weights alike), so TP ranks compute the TP=1 math:

- column-parallel (output rows split, ShardSpec(0)): the rank computes its slice of the output
  features; no communication.
- row-parallel (input columns split, ShardSpec(1)): the rank computes a partial sum of the full
  output; one all-reduce over the TP group completes it (`forward`), or the caller adds other
  partials first and reduces once (`partial`).
- vocabulary-parallel: rank r holds rows [r V/tp, (r+1) V/tp) of the embedding and LM head; the
  embedding zeroes the ids it does not hold and all-reduces, the LM head all-gathers the logits.

With a size-1 group every module here computes what its nn counterpart does (the same names,
shapes and ops; the collectives are no-ops).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kdaserve.distributed.comm import GroupComm


@dataclass(frozen=True)
class ShardSpec:
    """A tensor split across the TP ranks along `dim`; with blocks > 1 that dim is `blocks`
    equal blocks (q | k | v of a conv weight, gate | up of an expert) and each block is split,
    the rank's pieces kept in block order."""
    dim: int
    blocks: int = 1


def divide(n: int, size: int, what: str) -> int:
    """n // size; a ValueError naming `what` when size does not divide n."""
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={size}")
    return n // size


def shard(t: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """The rank's part of the full tensor t (a view when blocks == 1)."""
    n = t.shape[spec.dim]
    if n % (spec.blocks * size):
        raise ValueError(f"dim {spec.dim} of a tensor of shape {tuple(t.shape)} does not split "
                         f"into {spec.blocks} block(s) x tensor_parallel_size={size}")
    if spec.blocks == 1:
        step = n // size
        return t.narrow(spec.dim, rank * step, step)
    block = n // spec.blocks
    step = block // size
    return torch.cat([t.narrow(spec.dim, b * block + rank * step, step)
                      for b in range(spec.blocks)], dim=spec.dim)


def full_shape(local: torch.Size | tuple[int, ...], spec: ShardSpec,
               size: int) -> tuple[int, ...]:
    """The full tensor's shape from one rank's part."""
    shape = list(local)
    shape[spec.dim] *= size
    return tuple(shape)


def model_shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """Parameter / buffer name -> ShardSpec of every split tensor of `model` (each module
    declares its own with `tp_shards()`); tensors not named are replicated."""
    out: dict[str, ShardSpec] = {}
    for prefix, module in model.named_modules():
        declare = getattr(module, "tp_shards", None)
        if callable(declare):
            for name, spec in declare().items():
                out[f"{prefix}.{name}" if prefix else name] = spec
    return out


class ColumnParallelLinear(nn.Linear):
    """y[:, rank's features] = x @ W[rank's rows].T; weight [out_features / tp, in_features]."""

    def __init__(self, in_features: int, out_features: int, tp: GroupComm) -> None:
        super().__init__(in_features, divide(out_features, tp.size, "output features"),
                         bias=False)

    def tp_shards(self) -> dict[str, ShardSpec]:
        return {"weight": ShardSpec(0)}


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x[:, rank's features] @ W[:, rank's columns].T; weight
    [out_features, in_features / tp]."""

    def __init__(self, in_features: int, out_features: int, tp: GroupComm) -> None:
        super().__init__(divide(in_features, tp.size, "input features"), out_features,
                         bias=False)
        self.tp = tp

    def tp_shards(self) -> dict[str, ShardSpec]:
        return {"weight": ShardSpec(1)}

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum [T, out] (to be all-reduced by the caller)."""
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding over the rank's vocabulary rows; weight [vocab / tp, D]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: GroupComm) -> None:
        super().__init__()
        self.tp = tp
        rows = divide(num_embeddings, tp.size, "vocab_size")
        self.vocab_start = tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim))

    def tp_shards(self) -> dict[str, ShardSpec]:
        return {"weight": ShardSpec(0)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, D]."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        held = (local >= 0) & (local < self.weight.shape[0])                  # [T]
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(x * held[:, None].to(x.dtype))


class ParallelLMHead(nn.Module):
    """Logits over the full vocabulary from the rank's rows; weight [vocab / tp, D] (tied to
    the embedding's when the model ties them: the two split alike)."""

    def __init__(self, embedding_dim: int, num_embeddings: int, tp: GroupComm) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(divide(num_embeddings, tp.size, "vocab_size"),
                                               embedding_dim))

    def tp_shards(self) -> dict[str, ShardSpec]:
        return {"weight": ShardSpec(0)}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, vocab] (every rank gets all of them)."""
        return self.tp.all_gather(F.linear(hidden, self.weight), dim=-1)
