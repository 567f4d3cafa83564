"""Stored fla configs (kernels/fla_configs.py) round-trip through fla's own config cache: what
dump_configs writes, fla's exact-key lookup finds and installs as the kernel's config. Needs
fla-core (not CUDA); skipped where fla is not installed (the CPU CI: fla there would turn
transformers' CPU reference onto fla's GPU kernels)."""

import json
import os

import pytest

pytest.importorskip("fla")

from fla.ops.common.chunk_delta_h import (  # noqa: E402
    chunk_gated_delta_rule_fwd_kernel_h_blockdim64)
from fla.ops.utils import cache as fla_cache  # noqa: E402
from fla.ops.utils.cache import AutotuneKey, CachedAutotuner  # noqa: E402

from kdaserve.kernels import fla_configs  # noqa: E402

GPU = "NVIDIA H200"
KEY_A = (32, 32, 128, 128, 64, False, "torch.bfloat16", "torch.bfloat16", "torch.float32")
KEY_B = (16, 16, 128, 128, 64, False, "torch.bfloat16", "torch.bfloat16", "torch.float32")


@pytest.fixture
def fla_env():
    """fla's mode and the two environment variables, restored after the test."""
    saved = {k: os.environ.pop(k, None) for k in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")}
    mode = fla_cache.FLA_CACHE_MODE
    yield
    fla_cache.FLA_CACHE_MODE = mode
    for k, v in saved.items():
        os.environ.pop(k, None)
        if v is not None:
            os.environ[k] = v


@pytest.fixture
def tuner():
    t = chunk_gated_delta_rule_fwd_kernel_h_blockdim64
    while not isinstance(t, CachedAutotuner):    # under fla's triton.heuristics
        t = t.fn
    saved = dict(t.cache)
    yield t
    t.cache.clear()
    t.cache.update(saved)


def _same(a, b) -> bool:
    return (a.kwargs, a.num_warps, a.num_stages) == (b.kwargs, b.num_warps, b.num_stages)


def test_dump_then_fla_loads_the_same_config(tmp_path, fla_env, tuner):
    chosen_a, chosen_b = tuner.configs[-1], tuner.configs[0]
    tuner.cache.clear()
    tuner.cache[KEY_A] = chosen_a
    assert fla_configs.dump_configs(GPU, tmp_path, [tuner]) == {tuner.kernel_name: 1}
    tuner.cache.clear()
    tuner.cache[KEY_B] = chosen_b
    fla_configs.dump_configs(GPU, tmp_path, [tuner])          # merged into the same file
    path = tmp_path / "NVIDIA_H200" / f"{tuner.kernel_name}.json"
    data = json.loads(path.read_text())
    assert sorted(e["autotune_key"][0] for e in data["autotune_entries"].values()) == [16, 32]

    assert fla_configs.use_stored_configs(GPU, tmp_path) == path.parent
    assert fla_configs.use_stored_configs(GPU, tmp_path) == path.parent    # a second engine
    assert fla_cache.FLA_CACHE_MODE is fla_cache.FlaCacheMode.STRICT
    assert os.environ["FLA_CONFIG_DIR"] == str(path.parent)
    for key, chosen in ((KEY_A, chosen_a), (KEY_B, chosen_b)):
        tuner.cache.clear()
        tuner.maybe_load_cached_config(AutotuneKey(key), nargs={}, runtime_kwargs={})
        assert _same(tuner.cache[key], chosen)
    # strict: a key that was not stored stays unset (fla autotunes it)
    tuner.cache.clear()
    other = (8,) + KEY_A[1:]
    tuner.maybe_load_cached_config(AutotuneKey(other), nargs={}, runtime_kwargs={})
    assert other not in tuner.cache


def test_user_settings_and_missing_files_leave_fla_alone(tmp_path, fla_env, tuner):
    tuner.cache.clear()
    tuner.cache[KEY_A] = tuner.configs[0]
    fla_configs.dump_configs(GPU, tmp_path, [tuner])
    mode = fla_cache.FLA_CACHE_MODE
    assert fla_configs.use_stored_configs("NVIDIA A100-SXM4-80GB", tmp_path) is None
    assert "FLA_CONFIG_DIR" not in os.environ and fla_cache.FLA_CACHE_MODE is mode
    os.environ["FLA_CACHE_MODE"] = "disabled"
    assert fla_configs.use_stored_configs(GPU, tmp_path) is None
    assert "FLA_CONFIG_DIR" not in os.environ and fla_cache.FLA_CACHE_MODE is mode


@pytest.mark.gpu
def test_chunk_kda_runs_on_the_stored_configs(tmp_path, fla_env):
    """A real chunk_kda call autotunes; its keys are dumped with another candidate than the
    one chosen, the choices are dropped, and the same call then runs on the stored configs:
    every key it meets is served from the files (the swapped candidates come back)."""
    import torch
    from fla.ops.kda import chunk_kda

    if not torch.cuda.is_available():
        pytest.skip("CUDA")
    gpu = torch.cuda.get_device_name()
    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, D = 200, 4, 128

    def run():
        q, k, v, gate = (torch.randn(1, T, H, D, device="cuda", generator=g,
                                     dtype=torch.bfloat16) for _ in range(4))
        beta = torch.randn(1, T, H, device="cuda", generator=g, dtype=torch.bfloat16)
        cu = torch.tensor([0, 120, T], device="cuda", dtype=torch.int32)
        chunk_kda(q, k, v, gate, beta, initial_state=None, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True,
                  A_log=torch.zeros(H, device="cuda"), dt_bias=torch.zeros(H * D, device="cuda"),
                  cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
        torch.cuda.synchronize()

    os.environ["FLA_CACHE_MODE"] = "disabled"
    fla_cache.FLA_CACHE_MODE = fla_cache.FlaCacheMode.DISABLED
    saved = {id(t): (t, dict(t.cache)) for t in fla_configs.tuned_autotuners()}
    for t, _ in saved.values():          # this call's keys only
        t.cache.clear()
    try:
        run()
        tuners = [t for t in fla_configs.tuned_autotuners() if len(t.configs) > 1]
        assert tuners, "chunk_kda autotuned nothing"
        stored, swapped = {}, 0
        for t in tuners:
            for key, chosen in list(t.cache.items()):
                # another candidate that ran in the benchmark (finite time), where the tuner
                # met one key (configs_timings holds the last key's benchmark)
                timed = getattr(t, "configs_timings", None) or {}
                others = [c for c, tm in timed.items()
                          if len(t.cache) == 1 and tm[0] < float("inf") and not _same(c, chosen)]
                t.cache[key] = stored[(t.kernel_name, key)] = others[0] if others else chosen
                swapped += bool(others)
        assert swapped, "no kernel had a second candidate to store"
        fla_configs.dump_configs(gpu, tmp_path, tuners)
        for t in tuners:
            t.cache.clear()
        del os.environ["FLA_CACHE_MODE"]
        assert fla_configs.use_stored_configs(gpu, tmp_path) is not None
        run()
        for (name, key), config in stored.items():
            t = next(t for t in tuners if t.kernel_name == name)
            assert _same(t.cache[key], config), (name, key)
    finally:
        for t, cache in saved.values():
            t.cache.clear()
            t.cache.update(cache)


def test_a_gpu_without_files_takes_a_same_traits_gpus(tmp_path, fla_env, tuner):
    """The H200 has no folder of its own: it takes the one whose device.json names the same
    compute capability and SM count, never one that differs; its own folder, once written,
    wins."""
    hopper = {"capability": [9, 0], "multi_processor_count": 132}
    tuner.cache.clear()
    tuner.cache[KEY_A] = tuner.configs[0]
    fla_configs.dump_configs("NVIDIA H100 80GB HBM3", tmp_path, [tuner], traits=hopper)
    h100 = tmp_path / "NVIDIA_H100_80GB_HBM3"
    assert json.loads((h100 / "device.json").read_text()) == dict(name="NVIDIA H100 80GB HBM3",
                                                                   **hopper)
    fla_configs.dump_configs("NVIDIA A100-SXM4-80GB", tmp_path, [tuner],
                             traits={"capability": [8, 0], "multi_processor_count": 108})
    mode = fla_cache.FLA_CACHE_MODE
    # other traits, or none given: no fallback, fla autotunes as before
    assert fla_configs.use_stored_configs(
        "NVIDIA H100 PCIe", tmp_path, {"capability": [9, 0], "multi_processor_count": 114}) is None
    assert fla_configs.use_stored_configs(GPU, tmp_path) is None
    assert "FLA_CONFIG_DIR" not in os.environ and fla_cache.FLA_CACHE_MODE is mode
    assert fla_configs.use_stored_configs(GPU, tmp_path, hopper) == h100
    assert os.environ["FLA_CONFIG_DIR"] == str(h100)
    assert fla_cache.FLA_CACHE_MODE is fla_cache.FlaCacheMode.STRICT
    tuner.cache.clear()
    tuner.maybe_load_cached_config(AutotuneKey(KEY_A), nargs={}, runtime_kwargs={})
    assert _same(tuner.cache[KEY_A], tuner.configs[0])
    # the H200's own files, once a run on it wrote them, come first
    for k in ("FLA_CONFIG_DIR", "FLA_CACHE_MODE"):
        os.environ.pop(k)
    tuner.cache.clear()
    tuner.cache[KEY_A] = tuner.configs[-1]
    fla_configs.dump_configs(GPU, tmp_path, [tuner], traits=hopper)
    assert fla_configs.use_stored_configs(GPU, tmp_path, hopper) == tmp_path / "NVIDIA_H200"


def test_every_stored_folder_names_its_traits():
    """The shipped folders carry device.json, so a same-traits GPU can find them."""
    folders = [p for p in fla_configs.CONFIG_ROOT.iterdir() if p.is_dir()]
    assert folders
    for folder in folders:
        info = json.loads((folder / fla_configs.DEVICE_FILE).read_text())
        assert fla_configs.device_dir(info["name"]) == folder
        assert len(info["capability"]) == 2 and info["multi_processor_count"] > 0
