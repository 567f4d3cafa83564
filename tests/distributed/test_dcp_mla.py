"""Decode context parallelism on one MLA layer, two processes over gloo (torch.distributed
directly): each rank holds half of the heads (the tensor-parallel layer: q / kv_b / gate /
o_proj cut by head, kv_a replicated, o_proj all-reduced) and only its shard of the latent KV;
decodes and prefill chunks on top of cached context (chunked prefill), over several steps,
must give the output of the whole layer over the whole cache (DCP = 1), on random weights,
fp32."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kdaserve.attention.builder import build_metadata
from kdaserve.attention.dcp import DCPGroup
from kdaserve.attention.forward_context import ForwardContext
from kdaserve.attention.metadata import ModelCaches
from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.distributed.comm import GroupComm
from kdaserve.layers.mla import MLAttention
from kdaserve.layers.parallel import model_shard_specs, shard

WORLD = 2
BLOCK = 4            # tokens per physical block on a rank
HEADS = 4


def _args(heads: int, k3: bool) -> KimiLinearArgs:
    return KimiLinearArgs(vocab_size=16, hidden_size=48, num_hidden_layers=1,
                          layer_types=["full_attention"], mlp_layer_types=["dense"],
                          num_attention_heads=heads, kv_lora_rank=32, qk_nope_head_dim=16,
                          qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=24 if k3 else None,
                          mla_use_output_gate=k3)


def _full_layer(k3: bool) -> MLAttention:
    g = torch.Generator().manual_seed(7)
    layer = MLAttention(_args(HEADS, k3), mla_index=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    layer.process_weights_after_loading()
    return layer


def _tp_shard(full: MLAttention, rank: int, k3: bool, tp: GroupComm) -> MLAttention:
    """The tensor-parallel layer of this rank (its heads; o_proj all-reduced in its forward),
    cut from the full layer's weights as the loader cuts checkpoints (layers/parallel.py)."""
    part = MLAttention(_args(HEADS, k3), mla_index=0, tp=tp)
    specs = model_shard_specs(part)
    full_sd = full.state_dict()
    with torch.no_grad():
        part.load_state_dict({name: shard(full_sd[name], specs[name], rank, WORLD)
                              if name in specs else full_sd[name]
                              for name in part.state_dict()})
    part.process_weights_after_loading()
    return part


# (request, new tokens, context before them) per step: chunked prefills on cached context,
# decodes next to prefill chunks, one-token prompts (a rank with no key of a short context).
STEPS = [
    [(0, 13, 0), (1, 9, 0), (3, 1, 0)],
    [(1, 1, 9), (3, 1, 1), (0, 11, 13), (2, 5, 0)],
    [(0, 1, 24), (1, 1, 10), (2, 1, 5), (3, 1, 2)],
    [(0, 1, 25), (1, 1, 11), (3, 1, 3), (2, 17, 6)],
    [(0, 1, 26), (1, 1, 12), (2, 1, 23), (3, 1, 4)],
]


def _blocks(req: int, block_tokens: int, length: int = 64) -> list[int]:
    """Request req's block ids (disjoint per request, not in order)."""
    n = -(-length // block_tokens)
    return [(req * 17 + 5 * j) % 97 for j in range(n)]


def _run(layer, cache, dcp: DCPGroup | None) -> list[torch.Tensor]:
    outs = []
    logical = BLOCK * (dcp.size if dcp is not None else 1)
    for s, step in enumerate(STEPS):
        g = torch.Generator().manual_seed(100 + s)
        x = torch.randn(sum(n for _, n, _ in step), layer.o_proj.weight.shape[0], generator=g)
        md = build_metadata([n for _, n, _ in step], [c for _, _, c in step],
                            [_blocks(r, logical) for r, _, _ in step], [0] * len(step), BLOCK,
                            "cpu", dcp=dcp)
        with torch.no_grad():
            y = layer(x, ForwardContext(md, ModelCaches([cache], [], [])))
        outs.append(y)
    return outs


def _worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        for k3 in (False, True):
            full = _full_layer(k3)
            d = full.kv_lora_rank + full.rope_dim
            want = _run(full, torch.zeros(97, BLOCK, d), None)
            world = GroupComm(dist.group.WORLD, rank, WORLD)
            part = _tp_shard(full, rank, k3, world)
            assert part.num_heads == HEADS // WORLD
            for interleave in (1, 2, 4):
                cache = torch.zeros(97, BLOCK, d)
                got = _run(part, cache, DCPGroup.of(world, interleave))
                for s, (a, b) in enumerate(zip(got, want)):
                    err = ((a - b).norm() / b.norm()).item()
                    assert err < 1e-5, f"k3={k3} interleave={interleave} step {s}: {err:.2e}"
                # the rank stored only its positions: half the latent rows of the contexts
                stored = int((cache.abs().sum(-1) > 0).sum())
                total = sum(n for step in STEPS for _, n, _ in step)
                assert 0 < stored < total
                counts = torch.tensor([stored])
                dist.all_reduce(counts)
                assert int(counts) == total
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mla_layer_dcp2_equals_dcp1():
    mp.spawn(_worker, args=(_free_port(),), nprocs=WORLD, join=True)

