"""One-token MoE path (kdaserve.kernels.moe.single_token) vs reference.moe_experts.

CPU: the fp32 checks of moe_single_checks.py through the Triton interpreter in a subprocess
(TRITON_INTERPRET must be set before triton is imported), and input validation.
GPU (marked gpu): bf16 at the Kimi-Linear-48B expert shapes, against the fp64 reference and
against fused_moe; CUDA-graph replay with new routing.
"""


import pytest
import torch

import kernel_checks as kc
import moe_single_checks as msc

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_interpreter_single_token():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("moe_single_checks.py", timeout=60)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def _inputs(N=1, E=4, D=16, I=8, k=2):
    return (torch.randn(N, D), torch.randn(E, 2 * I, D), torch.randn(E, D, I),
            torch.rand(N, k), torch.zeros(N, k, dtype=torch.int32))


def test_bad_inputs_raise_value_error():
    from kdaserve.kernels.moe.single_token import fused_moe_single_token as f

    x, w13, w2, w, ids = _inputs(N=2)
    with pytest.raises(ValueError, match=r"one token: x must be \[1, D\], got \(2, 16\)"):
        f(x, w13, w2, w, ids)
    x, w13, w2, w, ids = _inputs()
    with pytest.raises(ValueError, match="shape mismatch"):
        f(x, w13, torch.randn(4, 16, 6), w, ids)
    with pytest.raises(ValueError, match=r"expected x \[N, D\], w13 \[E, 2I, D\]"):
        f(x, w13, w2[:, :, None], w, ids)
    with pytest.raises(ValueError, match="shape mismatch"):
        f(torch.randn(1, 12), w13, w2, w, ids)
    with pytest.raises(ValueError, match=r"topk_ids/topk_weights must be \[N=1, k\]"):
        f(x, w13, w2, torch.rand(1, 3), ids)
    with pytest.raises(ValueError, match=r"out must be \[1, D\]"):
        f(x, w13, w2, w, ids, out=torch.empty(1, 8))
    with pytest.raises(ValueError, match="int32/int64"):
        f(x, w13, w2, w, ids.float())


def test_config_tiles_must_be_powers_of_two():
    from kdaserve.kernels.moe.single_token import (DEFAULT_CONFIG, GemvConfig,
                                                   SingleTokenMoEConfig, _check_config,
                                                   fit_single_config)

    _check_config(DEFAULT_CONFIG)
    with pytest.raises(ValueError, match="gemv2.block_k must be a power of two, got 48"):
        _check_config(SingleTokenMoEConfig(GemvConfig(16, 32, 4, 1), GemvConfig(8, 48, 4, 1)))
    small = fit_single_config(DEFAULT_CONFIG, hidden=64, inter_size=48)
    assert (small.gemv1.block_rows, small.gemv1.block_k) == (16, 64)
    assert (small.gemv2.block_rows, small.gemv2.block_k) == (8, 64)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def weights_48b():
    w13, w2 = msc.make_weights("cuda", BF16, msc.E48, msc.D48, msc.I48)
    yield w13, w2
    del w13, w2
    torch.cuda.empty_cache()


@pytest.mark.gpu
@gpu
def test_model_shapes_bf16_gpu(weights_48b):
    w13, w2 = weights_48b
    for seed in range(3):
        x = msc.make_token("cuda", BF16, msc.D48, seed=seed)
        weights, ids = msc.model_routing("cuda", seed=seed)
        msc.check_single(f"48B seed={seed}", x, w13, w2, weights, ids, 1e-2, gather=True)
        msc.check_vs_fused(x, w13, w2, weights, ids)
        ids[0, 3] = -1                                        # one entry not local
        msc.check_single(f"48B dropped seed={seed}", x, w13, w2, weights, ids, 1e-2, gather=True)
        msc.check_vs_fused(x, w13, w2, weights, ids)


@pytest.mark.gpu
@gpu
def test_deterministic_gpu(weights_48b):
    w13, w2 = weights_48b
    x = msc.make_token("cuda", BF16, msc.D48)
    weights, ids = msc.model_routing("cuda")
    a = msc.run_single(x, w13, w2, weights, ids)
    b = msc.run_single(x, w13, w2, weights, ids)
    assert torch.equal(a, b), "two runs differ"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_repeated_ids_and_configs_gpu(dtype):
    from kdaserve.kernels.moe.single_token import GemvConfig, SingleTokenMoEConfig

    E, D, I = 12, msc.D48, msc.I48
    w13, w2 = msc.make_weights("cuda", dtype, E, D, I, seed=3)
    x = msc.make_token("cuda", dtype, D, seed=4)
    weights, ids = msc.random_routing("cuda", E, 9, seed=5)             # repeats
    ids[0, 2] = E
    for cfg in (None, SingleTokenMoEConfig(GemvConfig(32, 128, 8, 2), GemvConfig(16, 256, 8, 2)),
                SingleTokenMoEConfig(GemvConfig(8, 512, 4, 4), GemvConfig(4, 1024, 4, 1))):
        msc.check_single(f"{dtype} cfg={cfg}", x, w13, w2, weights, ids, kc.bound(dtype), cfg)


@pytest.mark.gpu
@gpu
def test_cuda_graph_replay_gpu(weights_48b):
    from kdaserve.kernels.moe.single_token import fused_moe_single_token

    w13, w2 = weights_48b
    x = msc.make_token("cuda", BF16, msc.D48)
    weights, ids = msc.model_routing("cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_moe_single_token(x, w13, w2, weights, ids)           # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_single_token(x, w13, w2, weights, ids)
    for trial in range(3):
        new_w, new_ids = msc.model_routing("cuda", seed=trial + 10)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        x.copy_(msc.make_token("cuda", BF16, msc.D48, seed=trial + 20))
        graph.replay()
        torch.cuda.synchronize()
        kc.assert_close(f"graph replay {trial}", out,
                        msc.reference(x, w13, w2, weights, ids, gather=True), BF16)
