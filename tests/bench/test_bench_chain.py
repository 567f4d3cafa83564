# SPDX-License-Identifier: Apache-2.0
"""benchmarks/bench_chain.py's CPU-side pieces: the --gemv-shapes parser, the sweep order that
starts an untuned shape next to the tuned config of the most alike measured shape, and the
--write-configs merge."""

import pytest
import torch


@pytest.fixture(scope="module")
def bench_chain(load_benchmark):
    return load_benchmark("bench_chain")


def test_gemv_shapes_parse_and_reject(bench_chain):
    got = bench_chain.parse_gemv_shapes("8336x2048,256x2048:fp32,")
    assert got == {"gemv_8336x2048": (8336, 2048, torch.bfloat16),
                   "gemv_256x2048_fp32": (256, 2048, torch.float32)}
    for bad in ("12x", "axb", "0x64", "64x64:fp8"):
        with pytest.raises(SystemExit, match="NxK"):
            bench_chain.parse_gemv_shapes(bad)


def test_sweep_starts_at_either_anchor(bench_chain):
    combos = [(1, 128, 1), (8, 256, 1), (4, 512, 4), (64, 1024, 8)]
    order = bench_chain.nearest_first(combos, (4, 512, 4), (8, 256, 1))
    assert order[:2] == [(8, 256, 1), (4, 512, 4)]          # distance 0 to an anchor, grid order
    assert order[-1] == (64, 1024, 8)
    assert bench_chain.nearest_first(combos, (1, 128, 1))[0] == (1, 128, 1)


def test_tuned_neighbour_is_the_nearest_measured_shape(bench_chain, monkeypatch):
    from kdaserve.kernels.linear.gemv import GemvConfig

    tuned = {"M=1,N=12576,K=2304,dtype=bfloat16": GemvConfig(8, 256, 1, 3),
             "M=1,N=2304,K=4096,dtype=bfloat16": GemvConfig(2, 1024, 1, 5),
             "M=1,N=256,K=2304,dtype=float32": GemvConfig(2, 1024, 1, 2),
             "M=2,N=8192,K=2048,dtype=bfloat16": GemvConfig(64, 128, 8, 2)}
    import kdaserve.kernels.linear.gemv as gemv_mod
    monkeypatch.setattr(gemv_mod, "tuned_configs", lambda name, sms: tuned)
    cpu = torch.device("cpu")
    assert bench_chain.tuned_neighbour(8192, 2048, torch.bfloat16, cpu) == GemvConfig(8, 256, 1, 3)
    assert bench_chain.tuned_neighbour(2048, 4096, torch.bfloat16, cpu) == GemvConfig(2, 1024, 1, 5)
    assert bench_chain.tuned_neighbour(256, 2048, torch.float32, cpu) == GemvConfig(2, 1024, 1, 2)
    assert bench_chain.tuned_neighbour(2304, 4096, torch.bfloat16, cpu) is None   # tuned itself


def test_write_configs_keeps_the_shadowed_file_and_only_real_wins(bench_chain, tmp_path):
    """A first device file starts from the SM-count file it shadows; a shape is written only
    where its best beats today's config by more than 2%; an existing device file is merged."""
    import json

    sms = tmp_path / "gemv_sms=132.json"
    sms.write_text(json.dumps({"M=1,N=2304,K=4096,dtype=bfloat16": {"block_n": 2}}))
    best = {"M=1,N=2048,K=2048,dtype=bfloat16": ({"block_n": 8}, 5.0, 6.0),     # 17% faster
            "M=1,N=8336,K=2048,dtype=bfloat16": ({"block_n": 4}, 9.9, 10.0)}    # 1%: kept
    path = bench_chain.write_gemv_configs(str(tmp_path), best, "NVIDIA H100 80GB HBM3", 132)
    assert path.name == "gemv_device_name=NVIDIA_H100_80GB_HBM3.json"
    got = json.loads(path.read_text())
    assert got == {"M=1,N=2304,K=4096,dtype=bfloat16": {"block_n": 2},
                   "M=1,N=2048,K=2048,dtype=bfloat16": {"block_n": 8}}
    bench_chain.write_gemv_configs(str(tmp_path), {"M=1,N=256,K=2048,dtype=float32": (
        {"block_n": 2}, 1.0, 2.0)}, "NVIDIA H100 80GB HBM3", 132)
    assert len(json.loads(path.read_text())) == 3
