"""Decode context parallelism end to end on the CPU (gloo, two rank processes): TP=2 with DCP=2
computes what TP=1 does, and holds twice the KV tokens of TP=2 in the same blocks.

Both families (the tiny Kimi Linear preset and kimi-k3-tiny with MXFP4 experts), prompts that
span several blocks on each rank, chunked prefill (chunks on top of a sharded cached context),
decodes; token- and block-level interleave; a second turn through the prefix cache; sizes and
combinations DCP refuses, named in the error."""

from __future__ import annotations


import pytest

from kdaserve import LLM, SamplingParams
from tests.distributed.conftest import close_logprobs
from tests.engine.conftest import assert_pools_free

pytestmark = pytest.mark.timeout(900)

BLOCK = 16
# 150 / 96 / 70 tokens: 5 / 3 / 3 logical blocks of 32 at DCP=2 (75 / 48 / 35 tokens per rank)
PROMPTS = [list(range(10, 160)), [4, 4, 8, 100, 12, 3] * 16, [1, 5, 9, 33, 7] * 14]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
SMALL = {"max_model_len": 512, "num_gpu_blocks": 64, "block_size": BLOCK,
         "max_num_batched_tokens": 48}          # chunked prefill: 48-token chunks


def run(model: str, turns: list[list[list[int]]], **kwargs):
    """Greedy outputs of each turn (a list of prompts, generated one turn after the other on the
    same engine): ([token ids], [logprobs]) per prompt, the engine's final stats. Its pools end
    free and its rank processes are shut down."""
    llm = LLM(model, **{**SMALL, **kwargs})
    try:
        tokens, logprobs = [], []
        for prompts in turns:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                use_tqdm=False)
            tokens += [o.outputs[0].token_ids for o in outs]
            logprobs += [o.outputs[0].logprobs for o in outs]
        assert_pools_free(llm.llm_engine)
        return tokens, logprobs, llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("family", ["tiny", "k3"])
def test_dcp2_greedy_equals_tp1_and_doubles_capacity(family, tiny_dir, k3_tp_dir, caplog):
    """tiny_dir, k3_tp_dir: tests/distributed/conftest.py (kimi-k3-tiny with its MXFP4 experts
    split on whole scale groups at TP=2). The capacity: the engine's stats, the start-up log
    line (rank 0 runs in this process) and the /metrics gauge."""
    from prometheus_client import generate_latest

    from kdaserve.entrypoints.openai.metrics import ServerMetrics

    model = tiny_dir if family == "tiny" else k3_tp_dir
    ref, ref_lp, ref_stats = run(model, [PROMPTS])
    tp2, _, tp2_stats = run(model, [PROMPTS], tensor_parallel_size=2)
    with caplog.at_level("INFO", logger="kdaserve.worker.worker"):
        got, got_lp, stats = run(model, [PROMPTS], tensor_parallel_size=2,
                                 decode_context_parallel_size=2)
    assert f"MLA KV cache: {2 * 64 * BLOCK} tokens;" in caplog.text
    metrics = ServerMetrics("m")
    metrics.engine_stats.stats = stats
    text = generate_latest(metrics.registry).decode()
    assert f'kdaserve:kv_cache_capacity_tokens{{model_name="m"}} {2 * 64 * BLOCK}.0' in text
    assert got == ref
    assert close_logprobs(got_lp, ref_lp)
    assert tp2 == ref
    assert stats.num_total_blocks == tp2_stats.num_total_blocks == 64
    assert tp2_stats.num_total_kv_tokens == ref_stats.num_total_kv_tokens == 64 * BLOCK
    assert stats.num_total_kv_tokens == 2 * tp2_stats.num_total_kv_tokens


def test_dcp2_block_interleave_and_prefix_hit_equal_tp1(tiny_dir):
    """Block-level interleave (positions in runs of block_size per rank), and a second turn
    that extends the first turn's prompts: it hits the prefix cache (shared logical blocks and
    a KDA checkpoint) and still matches TP=1."""
    second = [p + [7, 8, 9] * 5 for p in PROMPTS[:2]]
    ref, ref_lp, _ = run(tiny_dir, [PROMPTS[:2], second])
    got, got_lp, stats = run(tiny_dir, [PROMPTS[:2], second], tensor_parallel_size=2,
                             decode_context_parallel_size=2,
                             dcp_kv_cache_interleave_size=BLOCK)
    assert stats.prefix_cache_hits > 0
    assert got == ref
    assert close_logprobs(got_lp, ref_lp)


def test_dcp_refusals_name_the_values(tiny_dir):
    from kdaserve.config import ParallelConfig
    from kdaserve.engine.arg_utils import config_from_kwargs

    with pytest.raises(ValueError, match="decode_context_parallel_size=3 must divide "
                                         "tensor_parallel_size=2"):
        ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=3)
    with pytest.raises(ValueError, match="decode_context_parallel_size must be >= 1, got 0"):
        ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=0)
    with pytest.raises(ValueError, match="dcp_kv_cache_interleave_size=3 must divide "
                                         "block_size=16"):
        config_from_kwargs(dict(model=tiny_dir, tensor_parallel_size=2, block_size=16,
                                decode_context_parallel_size=2,
                                dcp_kv_cache_interleave_size=3))
    with pytest.raises(ValueError, match="decode_context_parallel_size=2 with speculative "
                                         "decoding \\(method 'ngram'\\) is not supported"):
        config_from_kwargs(dict(model=tiny_dir, tensor_parallel_size=2,
                                decode_context_parallel_size=2,
                                speculative_config={"method": "ngram",
                                                    "num_speculative_tokens": 2}))
    kvt = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    with pytest.raises(ValueError, match="kv_transfer_config with "
                                         "decode_context_parallel_size=2 is not supported"):
        config_from_kwargs(dict(model=tiny_dir, tensor_parallel_size=2,
                                decode_context_parallel_size=2, kv_transfer_config=kvt))
    with pytest.raises(ValueError, match="kv_transfer_config with nnodes=2"):
        config_from_kwargs(dict(model=tiny_dir, tensor_parallel_size=2, nnodes=2,
                                master_port=29500, kv_transfer_config=kvt))


def test_serve_and_bench_flags_reach_the_engine():
    from kdaserve.bench.launch import ServerProcess
    from kdaserve.entrypoints.cli import build_parser
    from kdaserve.entrypoints.openai.cli_args import engine_kwargs_from_args

    args = build_parser("serve").parse_args(["serve", "/m", "-tp", "4", "-dcp", "2",
                                             "--additional-config",
                                             '{"dcp_kv_cache_interleave_size": 8}'])
    assert engine_kwargs_from_args(args, "/m") == {
        "model": "/m", "tensor_parallel_size": 4, "decode_context_parallel_size": 2,
        "dcp_kv_cache_interleave_size": 8}
    long = build_parser("serve").parse_args(["serve", "/m", "--decode-context-parallel-size",
                                             "2"])
    assert long.decode_context_parallel_size == 2
    server = ServerProcess("/m", [], "/dev/null", port=1, tensor_parallel_size=2,
                           decode_context_parallel_size=2)
    assert server.cmd[-4:] == ["--tensor-parallel-size", "2", "--decode-context-parallel-size",
                               "2"]


@pytest.mark.gpu
def test_dcp2_cuda_graphs_equal_tp1_gpu(tiny_dir):
    """Two GPUs (NCCL): TP=2 DCP=2 with the decode CUDA graphs (the group's collectives
    captured inside, the Triton decode with lse and the merge kernel) against TP=1, in fp32."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    gpu = {"device": "cuda", "dtype": "float32", "num_gpu_blocks": None,
           "gpu_memory_utilization": 0.3}
    ref, _, _ = run(tiny_dir, [PROMPTS], **gpu)
    got, _, stats = run(tiny_dir, [PROMPTS], tensor_parallel_size=2,
                        decode_context_parallel_size=2, **gpu)
    assert got == ref
    assert stats.num_total_kv_tokens == 2 * stats.num_total_blocks * BLOCK
