"""Measured kernel configs as data (kdaserve/kernels/configs/): the H200's GEMV file holds
exactly the configs measured there, devices without a file of their own read the one for their
SM count, any other device gets the guess, and the files are package data."""

import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch

import kdaserve.kernels.linear.gemv as gemv_mod
from kdaserve.kernels.configs import (CONFIG_DIR, config_file_name, device_name, load_configs,
                                      shape_key)
from kdaserve.kernels.linear.gemv import GemvConfig, default_config, guess_config, tuned_configs

BF16, F32 = torch.bfloat16, torch.float32
H200 = "NVIDIA H200"

# (M, N, K, weight dtype) -> the config measured fastest on the H200 (benchmarks/PERF_NOTES.md)
MEASURED = {
    (1, 2304, 4096, BF16): GemvConfig(block_n=2, block_k=1024, num_warps=1, num_stages=5),
    (1, 12576, 2304, BF16): GemvConfig(block_n=8, block_k=256, num_warps=1, num_stages=3),
    (1, 6720, 2304, BF16): GemvConfig(block_n=8, block_k=128, num_warps=1, num_stages=4),
    (1, 256, 2304, F32): GemvConfig(block_n=2, block_k=1024, num_warps=1, num_stages=2),
    (1, 18432, 2304, BF16): GemvConfig(block_n=8, block_k=256, num_warps=1, num_stages=3),
    (1, 2304, 9216, BF16): GemvConfig(block_n=4, block_k=1024, num_warps=2, num_stages=4),
}
# kimi-k3-mini's dense decode shapes, measured on the H200 (bench_chain.py --gemv-shapes ...)
MEASURED_K3 = {
    (1, 8336, 2048, BF16): GemvConfig(block_n=16, block_k=512, num_warps=4, num_stages=3),
    (1, 2048, 2048, BF16): GemvConfig(block_n=8, block_k=1024, num_warps=8, num_stages=3),
    (1, 4096, 2048, BF16): GemvConfig(block_n=4, block_k=1024, num_warps=1, num_stages=3),
    (1, 3392, 2048, BF16): GemvConfig(block_n=8, block_k=1024, num_warps=4, num_stages=2),
    (1, 256, 2048, F32): GemvConfig(block_n=2, block_k=1024, num_warps=1, num_stages=3),
}


def _keyed(table):
    return {shape_key(M=M, N=N, K=K, dtype=dt): cfg for (M, N, K, dt), cfg in table.items()}


def test_shape_key_and_file_name():
    assert shape_key(M=1, N=2304, K=4096, dtype=BF16) == "M=1,N=2304,K=4096,dtype=bfloat16"
    assert config_file_name("gemv", H200) == "gemv_device_name=NVIDIA_H200.json"
    assert (CONFIG_DIR / config_file_name("gemv", H200)).is_file()


def test_h200_file_holds_the_measured_configs():
    assert tuned_configs(H200, 132) == _keyed(MEASURED | MEASURED_K3)
    assert all(cfg.prefetch == 2 for cfg in tuned_configs(H200, 132).values())


@pytest.mark.parametrize("name,sms", [(H200, 132), ("NVIDIA H100 80GB HBM3", 132), (None, 132)])
def test_devices_with_132_sms_use_the_measured_configs(name, sms, monkeypatch):
    """The H200 by name; another 132-SM device (H100 SXM) and CPU tensors by SM count."""
    monkeypatch.setattr(gemv_mod, "device_name", lambda device: name)
    monkeypatch.setattr(gemv_mod, "num_sms", lambda device: sms)
    for (M, N, K, dtype), cfg in MEASURED.items():
        assert default_config(M, N, K, dtype, torch.device("cpu")) == cfg
        assert default_config(M + 1, N, K, dtype, torch.device("cpu")) == guess_config(
            N, K, dtype, sms)


@pytest.mark.parametrize("name,sms", [("NVIDIA A100-SXM4-80GB", 108), ("NVIDIA H100 PCIe", 114),
                                      ("NVIDIA H200 MIG 3g.71gb", 60)])
def test_unknown_device_gets_the_guess(name, sms, monkeypatch):
    assert load_configs("gemv", name, sms) == {}
    monkeypatch.setattr(gemv_mod, "device_name", lambda device: name)
    monkeypatch.setattr(gemv_mod, "num_sms", lambda device: sms)
    for (M, N, K, dtype) in MEASURED:
        assert default_config(M, N, K, dtype, torch.device("cpu")) == guess_config(N, K, dtype,
                                                                                   sms)


def test_no_file_for_a_kernel_is_empty():
    assert load_configs("no_such_kernel", H200, 132) == {}


def test_device_name_of_cpu_tensors_is_none():
    assert device_name(torch.device("cpu")) is None and device_name(None) is None


def test_config_files_are_package_data():
    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["kdaserve"]
    files = sorted(CONFIG_DIR.glob("*.json"))
    assert files
    for path in files:
        rel = path.relative_to(root / "kdaserve").as_posix()
        assert any(fnmatch(rel, g) for g in globs), f"{rel} is not package data: {globs}"


def test_mxfp4_moe_tuned_tiles_nearest_measured_count(monkeypatch):
    """The MoE kernels take the device's measured tiles at the nearest measured token count
    (ties: the smaller), only within the measured range, per shape; nothing for CPU tensors."""
    import torch

    from kdaserve.kernels.moe import mxfp4_moe as m

    shape = (256, 16, 2048, 2048, "mxfp4")
    files = {("mxfp4_moe_gemm", "GPU"): {m.gemm_shape_key(1, *shape): {"block_n": 1},
                                         m.gemm_shape_key(4, *shape): {"block_n": 4},
                                         m.gemm_shape_key(16, *shape): {"block_n": 16}}}
    monkeypatch.setattr(m, "load_configs", lambda kernel, name, sms: files.get((kernel, name), {}))
    m._tuned_tiles.cache_clear()
    try:
        got = {n: (m._tuned_tiles("mxfp4_moe_gemm", n, shape, "GPU", 132) or {}).get("block_n")
               for n in (1, 2, 3, 5, 10, 16, 17)}
        assert got == {1: 1, 2: 1, 3: 4, 5: 4, 10: 4, 16: 16, 17: None}
        assert m._tuned_tiles("mxfp4_moe_gemm", 1, shape[:-1] + ("bf16",), "GPU", 132) is None
        assert m._tuned_tiles("latent_moe_tail", 1, (16, 2048, 2048), "GPU", 132) is None
        assert m._tuned_tiles("mxfp4_moe_gemm", 1, shape, "other", 132) is None
    finally:
        m._tuned_tiles.cache_clear()
    assert m.tuned_tiles("mxfp4_moe_gemm", 1, shape, torch.device("cpu")) is None
