"""Split-K router (moe_router_splitk): interpreter checks in a subprocess (router_checks.py), input
errors in process, and GPU tests at the Kimi-Linear-48B shapes (E=256, D=2304) against the cuBLAS
GEMM + top-k path and the float64 reference, plus batch invariance."""

import os

import pytest
import torch

import kernel_checks as kc
from kdaserve.kernels import reference as ref

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
E, D, TOP_K, SCALING = 256, 2304, 8, 2.446


def test_router_splitk_interpreter():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("router_checks.py", timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_too_many_tokens_names_n():
    pytest.importorskip("triton")
    from kdaserve.kernels.moe.router import moe_router_splitk

    with pytest.raises(ValueError, match="N=65"):
        moe_router_splitk(torch.randn(65, 64), torch.randn(8, 64), None, 2, True, 1.0)


def test_cpu_tensors_need_the_interpreter():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("interpreter mode accepts CPU tensors")
    from kdaserve.kernels.moe.router import moe_router_splitk

    with pytest.raises(ValueError, match="CUDA"):
        moe_router_splitk(torch.randn(2, 64), torch.randn(8, 64), None, 2, True, 1.0)


def _inputs(n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, D, device="cuda", generator=g).bfloat16()         # [N, D]
    w = torch.randn(E, D, device="cuda", generator=g) / D ** 0.5         # [E, D] fp32
    b = torch.randn(E, device="cuda", generator=g) * 0.1                 # [E]
    return x, w, b


def _dense(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[N, E] float64 map of each token's weights at its ids (order-free comparison)."""
    out = torch.zeros(ids.shape[0], E, dtype=torch.float64, device=ids.device)
    return out.scatter_(1, ids.long(), weights.double())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [1, 16, 64])
@pytest.mark.parametrize("fp32_in", [True, False])
def test_splitk_matches_cublas_and_reference_gpu(n, fp32_in):
    from kdaserve.kernels.moe.router import moe_router_splitk, moe_topk_sigmoid

    x, w, b = _inputs(n, seed=n)
    xin = x.float() if fp32_in else x
    weights, ids = moe_router_splitk(xin, w, b, TOP_K, True, SCALING, extra_expert=E)
    assert bool((weights[:, TOP_K] == 1).all()) and bool((ids[:, TOP_K] == E).all())
    got = _dense(weights[:, :TOP_K], ids[:, :TOP_K])
    old_w, old_ids = moe_topk_sigmoid(torch.nn.functional.linear(x.float(), w), b, TOP_K, True,
                                      SCALING, extra_expert=E)
    torch.testing.assert_close(got, _dense(old_w[:, :TOP_K], old_ids[:, :TOP_K]),
                               rtol=1e-5, atol=0)
    ref_w, ref_ids = ref.moe_topk_sigmoid(x.double() @ w.double().T, b, TOP_K, True, SCALING)
    torch.testing.assert_close(got, _dense(ref_w, ref_ids), rtol=1e-5, atol=0)
    again = moe_router_splitk(xin, w, b, TOP_K, True, SCALING, extra_expert=E)
    assert torch.equal(again[0], weights) and torch.equal(again[1], ids)       # deterministic


@pytest.mark.gpu
@gpu
def test_splitk_batch_invariance_gpu():
    """A token's (weights, ids) are bitwise the same alone, in a batch of 16 or of 64, and from
    bf16 x or its fp32 copy."""
    from kdaserve.kernels.moe.router import moe_router_splitk

    x, w, b = _inputs(64, seed=7)

    def route(rows):
        return moe_router_splitk(rows, w, b, TOP_K, True, SCALING, extra_expert=E)

    alone, b16, b64 = route(x[:1]), route(x[:16]), route(x)
    for out in (b16, b64):
        assert torch.equal(out[0][:1], alone[0]) and torch.equal(out[1][:1], alone[1])
    assert torch.equal(b64[0][:16], b16[0]) and torch.equal(b64[1][:16], b16[1])
    f32 = route(x.float())
    assert torch.equal(f32[0], b64[0]) and torch.equal(f32[1], b64[1])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [1, 16, 80])
def test_topk_router_layer_gpu(n):
    """TopkRouter with router_splitk on (split-K up to 64 rows, cuBLAS past) and off agree."""
    from kdaserve.layers.moe import TopkRouter
    from kdaserve.config.model_args import KimiLinearArgs

    args = KimiLinearArgs(vocab_size=64, hidden_size=D, num_hidden_layers=1,
                          layer_types=["full_attention"], mlp_layer_types=["sparse"])
    router = TopkRouter(args).cuda()
    x, w, b = _inputs(n, seed=3)
    router.weight.data.copy_(w)
    router.e_score_correction_bias.copy_(b)
    outs = []
    for splitk in (True, False):
        router.router_splitk = splitk
        for x32 in (None, x.float()):
            weights, ids = router(x, extra_expert=E, x32=x32)
            outs.append(_dense(weights[:, :TOP_K], ids[:, :TOP_K]))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=0)
