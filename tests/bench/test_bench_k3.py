# SPDX-License-Identifier: Apache-2.0
"""benchmarks/bench_k3.py's KL stage on the CPU with kimi-k3-tiny: the script runs end to end
and writes its figures, and its pieces do what the figure's definition needs (the MXFP4 twin
is the bf16 model with exactly its experts quantised; the weights are LeCun normal with the
depth-scaled output projections). A test of the script, not of the issue's KL bound."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_k3.py")


@pytest.fixture(scope="module")
def bench_k3(load_benchmark):
    return load_benchmark("bench_k3")


@pytest.fixture(scope="module")
def k3_tiny(tmp_path_factory):
    from kdaserve.models.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("bk3") / "k3tiny"), preset="kimi-k3-tiny")


def test_kl_stage_writes_its_figures(k3_tiny, tmp_path):
    out = tmp_path / "k3.json"
    proc = subprocess.run([sys.executable, SCRIPT, k3_tiny, "--device", "cpu", "--stages", "kl",
                           "--kl-prompts", "3", "--kl-len", "12", "--kl-batch", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.path.abspath(ROOT)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    kl = json.loads(out.read_text())["kl"]
    assert kl["tokens"] == 3 * 12 and kl["logit_std"] == 3.0
    by = [kl["kl_by_logit_std"][k]["kl"] for k in ("1", "2", "3", "4")]
    assert all(v > 0 and math.isfinite(v) for v in by)       # the twin differs, a little
    assert by == sorted(by)                                  # sharper logits, larger KL
    assert kl["mean_kl"] == kl["kl_by_logit_std"]["3"]["kl"]
    assert 0.0 <= kl["top1_agreement"] <= 1.0 and 0.0 < kl["logit_rel_err"] < 1.0
    assert kl["pass_kl_le_0_02"] == (kl["mean_kl"] <= 0.02)


def test_twin_is_the_quantised_model(bench_k3, k3_tiny):

    from kdaserve.config import KernelConfig
    from kdaserve.kernels.mxfp4.format import quantize_mxfp4
    from kdaserve.layers.backends import select_backends
    from kdaserve.models.loader import _loadable_tensors
    from kdaserve.models.registry import build_model, resolve_architecture

    mc = bench_k3.model_config(k3_tiny, "bf16", 64)
    args, cls = mc.arch, resolve_architecture(mc.hf_config)
    backends = select_backends(KernelConfig(), "cpu")
    dense = build_model(args, torch.float32, "cpu", cls, backends)
    bench_k3.realistic_init(dense, 0)
    dense.process_weights_after_loading()
    twin = bench_k3.mxfp4_twin(dense, args, torch.float32, "cpu", backends, cls)
    src, got = _loadable_tensors(dense), _loadable_tensors(twin)
    layers, RESIDUAL_OUTPUTS = args.num_hidden_layers, bench_k3.RESIDUAL_OUTPUTS
    for name, t in got.items():
        if name.endswith("_scale"):
            continue
        if name.endswith("_packed"):
            base = name.removesuffix("_packed")
            p, s = quantize_mxfp4(src[base].data[1])
            assert torch.equal(t.data[1], p) and torch.equal(got[base + "_scale"].data[1], s)
        else:
            assert torch.equal(t.data, src[name].data), name
    std = {n: src[n].data.std().item() * math.sqrt(src[n].shape[-1]) for n in src
           if n.endswith("proj.weight") and "experts." not in n}
    scaled = [v for n, v in std.items() if n.endswith(RESIDUAL_OUTPUTS)]
    plain = [v for n, v in std.items() if not n.endswith(RESIDUAL_OUTPUTS)]
    assert scaled and plain                      # LeCun normal, output projections depth-scaled
    assert max(scaled) < 1.6 / math.sqrt(2 * layers) and min(plain) > 0.6
    prompts = [[5, 9, 17, 3], [1, 2, 3, 4, 5, 6]]
    a = bench_k3.prefill_logits(dense, args, prompts, torch.float32, "cpu")
    b = bench_k3.prefill_logits(twin, args, prompts, torch.float32, "cpu")
    assert a.shape == (10, args.vocab_size) and not torch.equal(a, b)
    assert torch.equal(a, bench_k3.prefill_logits(dense, args, prompts, torch.float32, "cpu"))


def test_bit_decode_baseline_turns_the_table_decode_off_and_back(bench_k3):
    """The mxfp4-bits decode run's switch: inside, moe_partials' default config has
    lut_decode off (other tiles unchanged); after, the module's function is the original."""
    from kdaserve.kernels.moe import mxfp4_moe

    orig = mxfp4_moe.default_config
    with bench_k3.bit_decode(True):
        inside = mxfp4_moe.default_config(1, 16, 256)
    assert mxfp4_moe.default_config is orig
    assert not inside.lut_decode and orig(1, 16, 256).lut_decode
    assert dataclasses.replace(inside, lut_decode=True) == orig(1, 16, 256)
    with bench_k3.bit_decode(False):
        assert mxfp4_moe.default_config is orig
