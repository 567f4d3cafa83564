"""The ablation switches and engine flags of `kdaserve serve` reach the engine config."""

from __future__ import annotations

from kdaserve.engine.arg_utils import config_from_kwargs
from kdaserve.entrypoints.cli import build_parser
from kdaserve.entrypoints.openai.cli_args import engine_kwargs_from_args


def test_switches_reach_engine_config(tmp_path):
    from kdaserve.models.make_model import make_model

    model = make_model(str(tmp_path / "tiny"), preset="tiny")
    args = build_parser("serve").parse_args([
        "serve", model, "--kda-checkpoint-mode", "split", "--kda-checkpoint-interval", "128",
        "--num-kda-checkpoint-slots", "7", "--no-kda-checkpoint-turn-end",
        "--no-adaptive-spec-budget", "--dummy-routing", "spread",
        "--long-prefill-token-threshold", "64", "--max-model-len", "1k",
        "--no-async-scheduling", "--pdl", "--fused-kda-decode",
        "--no-decode-gemv", "--fused-router"])
    config = config_from_kwargs(engine_kwargs_from_args(args, model))
    cc, sc, lc = config.cache_config, config.scheduler_config, config.load_config
    assert (cc.kda_checkpoint_mode, cc.kda_checkpoint_interval, cc.num_kda_checkpoint_slots,
            cc.kda_checkpoint_turn_end) == ("split", 128, 7, False)
    assert sc.adaptive_spec_budget is False and sc.long_prefill_token_threshold == 64
    assert sc.async_scheduling is False
    assert lc.dummy_routing == "spread" and sc.max_model_len == 1000
    kc = config.kernel_config
    assert not kc.decode_gemv and kc.pdl and kc.fused_kda_decode and kc.fused_router
    defaults = config_from_kwargs(engine_kwargs_from_args(
        build_parser("serve").parse_args(["serve", model]), model))
    assert defaults.cache_config.kda_checkpoint_mode == "internal"
    assert defaults.scheduler_config.adaptive_spec_budget is True
    assert defaults.scheduler_config.async_scheduling is True
    dk = defaults.kernel_config
    assert dk.decode_gemv and dk.pdl and dk.fused_kda_decode and not dk.fused_router


def test_kernel_config_reaches_the_layers(tmp_path):
    """configure_kernels sets the flags on every KDA, MLA, router and MoE layer; on the CPU the
    reference path ignores them (same tokens)."""
    from kdaserve import LLM, SamplingParams
    from kdaserve.models.make_model import make_model

    model = make_model(str(tmp_path / "tiny"), preset="tiny")
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = []
    for on in (False, True):
        llm = LLM(model, max_model_len=256, decode_gemv=on, pdl=on, fused_kda_decode=on,
                  fused_router=on, mla_absorb_gemv=on, kda_state_prefetch=on,
                  dense_mlp_gemv=on)
        mods = list(llm.llm_engine.model_runner.model.modules())
        for name in ("decode_gemv", "fused_decode", "fused_router", "absorb_gemv",
                     "state_prefetch", "dense_gemv"):
            flags = [getattr(m, name) for m in mods if hasattr(m, name)]
            assert flags and all(f == on for f in flags), name
        # PDL is for captured graphs only: eager steps (all of them on the CPU) launch without.
        assert llm.llm_engine.model_runner.kernel_config.pdl == on
        assert not any(getattr(m, "pdl", False) for m in mods)
        outs.append(llm.generate([{"prompt_token_ids": [5, 6, 7]}], sp, use_tqdm=False)[0]
                    .outputs[0].token_ids)
        del llm
    assert outs[0] == outs[1]


def test_metrics_export_checkpoint_gauges():
    from prometheus_client import generate_latest

    from kdaserve.core.engine_output import SchedulerStats
    from kdaserve.entrypoints.openai.metrics import ServerMetrics

    m = ServerMetrics("m")
    m.engine_stats.stats = SchedulerStats(num_kda_checkpoints=3, num_total_kda_checkpoint_slots=8,
                                          num_kda_checkpoint_exports=5, step_floor_ratio=2.5)
    text = generate_latest(m.registry).decode()
    assert 'kdaserve:num_kda_checkpoints{model_name="m"} 3.0' in text
    assert 'kdaserve:num_total_kda_checkpoint_slots{model_name="m"} 8.0' in text
    assert 'kdaserve:kda_checkpoint_exports_total{model_name="m"} 5.0' in text
    assert 'kdaserve:step_floor_ratio{model_name="m"} 2.5' in text


def test_default_token_budget_follows_gpu_memory(monkeypatch):
    import types

    import torch

    from kdaserve.engine import arg_utils

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for gib, want in ((141, 8192), (180, 16384)):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i, gib=gib: types.SimpleNamespace(total_memory=gib * 2**30))
        assert arg_utils.default_max_num_batched_tokens("auto") == want
    assert arg_utils.default_max_num_batched_tokens("cpu") == 8192
