"""Each TP rank holds exactly its slice of the TP=1 weights: checkpoints in every naming scheme
(make-model's transformers >= 5.17 names, Moonshot's via transformers, Kimi K3's with MXFP4
experts) and dummy weights, cut by the modules' shard specs; replicated tensors are whole."""

from __future__ import annotations

import pytest
import torch

from kdaserve.config import LoadConfig, ModelConfig
from kdaserve.distributed.comm import GroupComm
from kdaserve.layers.parallel import ShardSpec, model_shard_specs, shard
from kdaserve.models.loader import load_weights, piece_spec
from kdaserve.models.registry import build_model, resolve_architecture


def _load(path: str, load_format: str, tp: GroupComm | None):
    mc = ModelConfig(path)
    model = build_model(mc.arch, torch.float32, "cpu", resolve_architecture(mc.hf_config),
                        tp=tp)
    load_weights(model, path, LoadConfig(load_format=load_format))
    return model


@pytest.mark.parametrize("family,load_format", [("tiny", "auto"), ("hf_tiny", "auto"),
                                                ("k3", "auto"), ("tiny", "dummy"),
                                                ("k3", "dummy")])
def test_each_rank_holds_its_slice(family, load_format, tiny_dir, hf_tiny_dir, k3_tp_dir):
    path = {"tiny": tiny_dir, "hf_tiny": hf_tiny_dir, "k3": k3_tp_dir}[family]
    full = _load(path, load_format, None).state_dict()
    split = 0
    for rank in range(2):
        model = _load(path, load_format, GroupComm(object(), rank, 2))   # no group: load only
        specs = model_shard_specs(model)
        for name, t in model.state_dict().items():
            spec = specs.get(name)
            want = full[name] if spec is None else shard(full[name], spec, rank, 2)
            assert t.shape == want.shape and torch.equal(t, want), name
            split += spec is not None
    assert split > 20


def test_piece_specs():
    # q_conv1d is block 0 of conv1d's three: split whole
    assert piece_spec(ShardSpec(0, 3), ("rows", 0, 3)) == ShardSpec(0)
    # experts.{e}.w1 is rows [0, I) of gate_up_proj[e]: split whole along its rows
    assert piece_spec(ShardSpec(1, 2), ("expert_rows", 4, 0, 2)) == ShardSpec(0)
    # experts.{e}.w2 is down_proj[e] [D, I]: its columns
    assert piece_spec(ShardSpec(2), ("expert", 4)) == ShardSpec(1)
    with pytest.raises(ValueError, match="not split by expert"):
        piece_spec(ShardSpec(0), ("expert", 1))


def test_the_loader_refuses_sizes_that_do_not_split(tiny_dir):
    with pytest.raises(ValueError, match=r"linear_num_heads \(KDA heads\)=2 is not divisible "
                                         r"by tensor_parallel_size=4"):
        _load(tiny_dir, "dummy", GroupComm(object(), 0, 4))
