"""Triton kernels vs their plain-PyTorch twins.

GPU tests (marked gpu) run the kernels at the model's sizes in bf16 and fp32. Without a GPU, one
test runs the fp32 subset through the Triton CPU interpreter in a subprocess (TRITON_INTERPRET
must be set before triton is imported, and must not leak into GPU tests).
"""

import os

import pytest
import torch

import kernel_checks as kc

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_interpreter_suite():
    pytest.importorskip("triton")
    proc = kc.run_under_interpreter("kernel_checks.py", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_kernels_refuse_cpu_tensors_without_interpreter():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("interpreter mode accepts CPU tensors")
    from kdaserve.kernels.moe.fused_moe import fused_moe

    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="CUDA"):
        fused_moe(x, torch.randn(4, 8, 8), torch.randn(4, 8, 4), torch.rand(2, 2),
                  torch.zeros(2, 2, dtype=torch.int32))


def test_tma_weights_need_16_byte_rows():
    """A TMA descriptor's row stride must be a multiple of 16 bytes: hidden 60 in fp32 (240
    bytes) passes, 58 in bf16 (116) is refused naming the value; strided experts too."""
    from kdaserve.kernels.moe.fused_moe import MoEGemmConfig, _weights

    cfg = MoEGemmConfig(64, 32, 32, 1, 4, 2, tma_weights=True)
    assert _weights(torch.zeros(3, 8, 60), cfg).shape == [24, 60]
    with pytest.raises(ValueError, match="multiple of 16 bytes.*got K=58, block_k=32"):
        _weights(torch.zeros(3, 8, 58, dtype=torch.bfloat16), cfg)
    with pytest.raises(ValueError, match="contiguous expert weights"):
        _weights(torch.zeros(3, 16, 64)[:, ::2], cfg)
    assert _weights(torch.zeros(3, 8, 58), MoEGemmConfig(64, 32, 32, 1, 4, 2)).shape == (3, 8, 58)


def test_bad_shapes_name_the_value():
    from kdaserve.kernels.mla.decode import _check_mla_inputs

    q = torch.randn(2, 4, 576)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        _check_mla_inputs(q, torch.randn(3, 24, 576), torch.zeros(2, 4, dtype=torch.int32),
                          torch.zeros(2, dtype=torch.int32), 512)
    with pytest.raises(ValueError, match="q last dim 576 != kv_cache last dim 512"):
        _check_mla_inputs(q, torch.randn(3, 16, 512), torch.zeros(2, 4, dtype=torch.int32),
                          torch.zeros(2, dtype=torch.int32), 512)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

BF16, F32 = torch.bfloat16, torch.float32


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("page", [16, 64])
def test_mla_decode_gpu(dtype, page):
    lens = torch.randint(1, 3000, (6,)).tolist() + [0, 1, 8192]
    kc.check_mla_decode("cuda", dtype, lens, num_heads=32, page=page, seed=page)
    kc.check_mla_decode("cuda", dtype, [4097], num_heads=32, page=page, seed=1)   # batch 1
    kc.check_mla_decode("cuda", dtype, [300, 5], num_heads=16, page=page, num_kv_splits=1)
    kc.check_mla_decode("cuda", dtype, [513, 2000], num_heads=20, page=page, num_kv_splits=7)
    kc.check_mla_decode("cuda", dtype, [4097, 3], num_heads=32, page=page, split_q=True)


@pytest.mark.gpu
@gpu
# (128 rows, 8 warps) needs 340 KB of shared memory, over the H200's 227 KB: not a config
@pytest.mark.parametrize("block_n,num_warps", [(64, 4), (64, 8), (32, 4)])
def test_mla_decode_transposed_gpu(block_n, num_warps):
    from kdaserve.kernels.mla.decode import MLADecodeConfig

    cfg = MLADecodeConfig(32, block_n, num_warps, 2, transposed=True)
    lens = torch.randint(1, 3000, (5,)).tolist() + [0, 8192]
    kc.check_mla_decode("cuda", BF16, lens, num_heads=32, page=16, config=cfg, seed=block_n)
    kc.check_mla_decode("cuda", BF16, [700, 33], num_heads=20, page=64, config=cfg)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows,block_n,num_warps", [(2, 32, 8), (2, 64, 8), (4, 32, 8)])
def test_mla_decode_fold_gpu(rows, block_n, num_warps):
    """The fold kernel at the model's dims: K = 8 verify windows (9 rows a sequence)."""
    from kdaserve.kernels.mla.decode import MLADecodeConfig

    cfg = MLADecodeConfig(32, block_n, num_warps, 2, transposed=True, rows=rows)
    lens = torch.randint(9, 3000, (5,)).tolist() + [8192, 3]
    kc.check_mla_decode_fold("cuda", BF16, lens, 9, cfg, num_heads=32, kv_lora_rank=512,
                             rope=64, seed=rows + block_n)
    kc.check_mla_decode_fold("cuda", BF16, [700, 33], 9, cfg, num_heads=20, page=64,
                             kv_lora_rank=512, rope=64, num_kv_splits=3)


@pytest.mark.gpu
@gpu
def test_store_latent_gpu():
    for dtype in (BF16, F32):
        kc.check_store_latent("cuda", dtype)
        kc.check_store_latent("cuda", dtype, num_tokens=300, rank=512, rope=64, seed=3)


@pytest.mark.gpu
@gpu
def test_store_kv_gpu():
    kc.check_store_kv("cuda", BF16)
    kc.check_store_kv("cuda", F32, page=64)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_fused_moe_gpu(dtype):
    for n in (1, 16, 77):
        kc.check_fused_moe("cuda", dtype, n, hidden=512, inter=256, num_experts=64, top_k=8,
                           seed=n)
    kc.check_fused_moe("cuda", dtype, 600, hidden=512, inter=256, num_experts=64, top_k=8)
    kc.check_fused_moe("cuda", dtype, 300, hidden=512, inter=256, num_experts=64, top_k=8,
                       same_experts=True)
    kc.check_fused_moe("cuda", dtype, 33, hidden=320, inter=96, num_experts=10, top_k=3,
                       drop_some=True)


@pytest.mark.gpu
@gpu
def test_moe_align_gpu():
    for n, bm in ((1, 16), (8, 16), (16, 16), (700, 64), (5000, 128)):
        kc.check_moe_align("cuda", n, top_k=8, num_experts=256, block_m=bm, seed=n)
    # decode at the model's routing (256 routed + shared = 257, k = 9): 144, 576, 1017 entries
    # on the one-program path (entry order checked), 1026 on the atomic one
    for n in (16, 64, 113, 114):
        for bm in (16, 64):
            kc.check_moe_align("cuda", n, top_k=9, num_experts=257, block_m=bm, seed=n + bm)
    kc.check_moe_align("cuda", 64, top_k=9, num_experts=257, block_m=16, same_experts=True)


@pytest.mark.gpu
@gpu
def test_router_gpu():
    for n in (1, 16, 3000):
        kc.check_router("cuda", num_tokens=n, seed=n)
    kc.check_router("cuda", num_tokens=33, logits_dtype=BF16, renormalize=False)
    kc.check_router("cuda", num_tokens=33, num_experts=100, top_k=6)


@pytest.mark.gpu
@gpu
def test_fused_moe_model_shapes_gpu():
    # Kimi-Linear-48B expert shapes (D=2304, I=1024, k=8), 64 experts to keep memory small.
    for n in (1, 16, 1024):
        kc.check_fused_moe("cuda", BF16, n, hidden=2304, inter=1024, num_experts=64, top_k=8,
                           seed=n)


@pytest.mark.gpu
@gpu
def test_fused_moe_tma_weights_gpu():
    """The expert weights by TMA descriptors (default_config's wgmma classes with tma_weights)
    at the Kimi-Linear-48B expert shapes, same-expert and spread routing, and at a shape whose
    K and N tails cross the gate / up halves."""
    from kdaserve.kernels.moe.fused_moe import default_config

    for n, same in ((64, True), (1024, False), (8000, True)):
        cfg = default_config(n, 8, 64, BF16, tma_weights=True)
        assert cfg.gemm1.tma_weights and cfg.gemm2.tma_weights
        kc.check_fused_moe("cuda", BF16, n, hidden=2304, inter=1024, num_experts=64, top_k=8,
                           same_experts=same, seed=n, config=cfg)
    from kdaserve.kernels.moe.fused_moe import FusedMoEConfig, MoEGemmConfig

    c = MoEGemmConfig(64, 64, 64, 4, 4, 3, tma_weights=True)
    for dtype in (BF16, F32):
        kc.check_fused_moe("cuda", dtype, 300, hidden=328, inter=96, num_experts=10, top_k=3,
                           drop_some=True, config=FusedMoEConfig(c, c))


@pytest.mark.gpu
@gpu
def test_fused_moe_gemm2_sum_model_shapes_gpu():
    """N == 1 at the Kimi-Linear-48B shapes (256 routed + the shared expert as id 256, k = 8 + 1):
    GEMM 2 + top-k sum in one kernel vs the reference and vs gemm2 + moe_sum."""
    for seed, bad_id in ((0, None), (1, -1), (2, 257)):
        kc.check_fused_moe_gemm2_sum("cuda", BF16, hidden=2304, inter=1024, num_experts=257,
                                      top_k=9, bad_id=bad_id, against_old=True, shared=True,
                                      seed=seed)
    kc.check_fused_moe_gemm2_sum("cuda", F32, hidden=2304, inter=1024, num_experts=257,
                                  top_k=9, against_old=True, shared=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_mla_prefill_attention_gpu(dtype):
    """The model's dims (nope 128, rope 64, v 128) at the default tiles: a whole prompt, a chunk
    after cached context off the block grid, a short chunk; the tiny preset's padded dims.
    fp32: exact products (ieee dots), held to the fp32 bound."""
    kc.check_mla_prefill_attention("cuda", dtype, q_len=1500, H=4, nope=128, rope=64, v=128)
    kc.check_mla_prefill_attention("cuda", dtype, q_len=700, kv_len=2101, H=4, nope=128,
                                   rope=64, v=128, seed=1)
    kc.check_mla_prefill_attention("cuda", dtype, q_len=5, kv_len=300, H=32, nope=128, rope=64,
                                   v=128, seed=2)
    kc.check_mla_prefill_attention("cuda", dtype, q_len=77, kv_len=90, H=2, nope=16, rope=8,
                                   v=16, seed=3)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_causal_conv1d_gpu(dtype):
    for tiles in (None, (32, 1024, 4), (8, 2048, 8)):
        kc.check_conv_varlen("cuda", dtype, [5, 0, 1, 2, 700, 3, 64], dim=12288, tiles=tiles)
    kc.check_conv_varlen("cuda", dtype, [1000], dim=300, pad_rows=0)
    kc.check_conv_update("cuda", dtype, batch=16, dim=12288)
    kc.check_conv_update("cuda", dtype, batch=3, dim=100, width=3)


@pytest.mark.gpu
@gpu
def test_cuda_graph_replay_gpu():
    """The three decode-path kernels capture once and replay with new seq_lens / routing / slots."""
    from kdaserve.kernels import reference as ref
    from kdaserve.kernels.conv.causal_conv1d import causal_conv1d_update
    from kdaserve.kernels.mla.decode import mla_decode
    from kdaserve.kernels.moe.fused_moe import fused_moe

    dev, B, H = "cuda", 8, 32
    kv, bt = kc.make_paged_kv(dev, BF16, [2048] * B, 16, 576)
    q = torch.randn(B, H, 576, device=dev, dtype=BF16)
    seq_lens = torch.full((B,), 100, dtype=torch.int32, device=dev)
    x = torch.randn(B, 512, device=dev, dtype=BF16)
    w13 = torch.randn(32, 512, 512, device=dev, dtype=BF16) * 512 ** -0.5
    w2 = torch.randn(32, 512, 256, device=dev, dtype=BF16) * 256 ** -0.5
    weights, ids = kc.make_routing(dev, B, 32, 4)
    xc = torch.randn(B, 64, device=dev, dtype=BF16)
    wc = torch.randn(64, 4, device=dev)
    states = torch.randn(2 * B, 64, 3, device=dev, dtype=BF16)
    idx = torch.arange(B, dtype=torch.int32, device=dev)

    def step():
        return (mla_decode(q, kv, bt, seq_lens, 0.07, 512), fused_moe(x, w13, w2, weights, ids),
                causal_conv1d_update(xc, wc, states, idx))

    graph, outs = kc.capture_graph(step)
    for trial in range(2):
        seq_lens.copy_(torch.randint(0, 2048, (B,), device=dev, dtype=torch.int32))
        new_w, new_ids = kc.make_routing(dev, B, 32, 4, seed=trial + 5)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        idx.copy_(torch.randperm(2 * B, device=dev)[:B].int())
        before = states.clone()
        graph.replay()
        torch.cuda.synchronize()
        kc.assert_close("graph mla", outs[0], ref.mla_decode(q.double(), kv.double(), bt,
                                                             seq_lens, 0.07, 512), BF16)
        kc.assert_close("graph moe", outs[1], ref.moe_experts(
            x.double(), w13.double(), w2.double(), weights, ids.long()), BF16)
        st = before.double()
        kc.assert_close("graph conv", outs[2], ref.causal_conv1d_update(
            xc.double(), wc.double(), st, idx), BF16)
        kc.assert_close("graph conv state", states, st, BF16)
