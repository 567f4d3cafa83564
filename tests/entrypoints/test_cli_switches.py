"""The optimisation switches (--optimization-config), the loader options
(--model-loader-extra-config) and the engine flags of `kdaserve serve` reach the engine config."""

from __future__ import annotations

import json

import pytest

from kdaserve.engine.arg_utils import config_from_kwargs
from kdaserve.entrypoints.cli import build_parser
from kdaserve.entrypoints.openai.cli_args import engine_kwargs_from_args


def parse(*argv):
    return build_parser("serve").parse_args(["serve", *argv])


def test_optimization_config_reaches_kernel_config(tmp_path):
    from kdaserve.models.make_model import make_model

    model = make_model(str(tmp_path / "tiny"), preset="tiny")
    args = parse(model, "--optimization-config", '{"decode_gemv": false, "pdl": true}')
    kc = config_from_kwargs(engine_kwargs_from_args(args, model)).kernel_config
    assert not kc.decode_gemv and kc.pdl
    assert kc.fused_kda_decode and kc.sampling_threshold_kernel  # keys left out: the defaults


def test_switches_reach_engine_config(tmp_path):
    from kdaserve.models.make_model import make_model

    model = make_model(str(tmp_path / "tiny"), preset="tiny")
    optimization = {"kda_checkpoint_mode": "split", "kda_checkpoint_interval": 128,
                    "num_kda_checkpoint_slots": 7, "kda_checkpoint_turn_end": False,
                    "adaptive_spec_budget": False, "pdl": True, "fused_kda_decode": True,
                    "decode_gemv": False, "kda_state_prefetch": False,
                    "mla_absorb_gemv": False, "dense_mlp_gemv": False,
                    "sampling_threshold_kernel": False}
    args = parse(model, "--optimization-config", json.dumps(optimization),
                 "--model-loader-extra-config", '{"dummy_routing": "spread"}',
                 "--long-prefill-token-threshold", "64", "--max-model-len", "1k",
                 "--no-async-scheduling")
    config = config_from_kwargs(engine_kwargs_from_args(args, model))
    cc, sc, lc = config.cache_config, config.scheduler_config, config.load_config
    assert (cc.kda_checkpoint_mode, cc.kda_checkpoint_interval, cc.num_kda_checkpoint_slots,
            cc.kda_checkpoint_turn_end) == ("split", 128, 7, False)
    assert sc.adaptive_spec_budget is False and sc.long_prefill_token_threshold == 64
    assert sc.async_scheduling is False
    assert lc.dummy_routing == "spread" and sc.max_model_len == 1000
    kc = config.kernel_config
    assert not kc.decode_gemv and kc.pdl and kc.fused_kda_decode
    assert not (kc.kda_state_prefetch or kc.mla_absorb_gemv or kc.dense_mlp_gemv
                or kc.sampling_threshold_kernel)
    defaults = config_from_kwargs(engine_kwargs_from_args(parse(model), model))
    assert defaults.cache_config.kda_checkpoint_mode == "internal"
    assert defaults.scheduler_config.adaptive_spec_budget is True
    assert defaults.scheduler_config.async_scheduling is True
    assert defaults.load_config.dummy_routing == "vllm"
    dk = defaults.kernel_config
    assert dk.decode_gemv and dk.pdl and dk.fused_kda_decode
    # 0 checkpoint slots is accepted (no KDA checkpoints); the engine checks the interval
    zero = parse(model, "--optimization-config", '{"num_kda_checkpoint_slots": 0}')
    assert config_from_kwargs(engine_kwargs_from_args(zero, model)) \
        .cache_config.num_kda_checkpoint_slots == 0
    odd = parse(model, "--optimization-config", '{"kda_checkpoint_interval": 100}')
    with pytest.raises(ValueError, match="multiple of block_size"):
        config_from_kwargs(engine_kwargs_from_args(odd, model))


@pytest.mark.parametrize("option,value,match", [
    ("--optimization-config", '{"decode_gemv": false, "fused_router": true}',
     "unknown key 'fused_router'; valid keys: decode_gemv, pdl,"),
    ("--optimization-config", '{"router_splitk": false}', "unknown key 'router_splitk'"),
    ("--optimization-config", '{"pdl": "yes"}', "'pdl' must be bool, got \"yes\""),
    ("--optimization-config", '{"decode_gemv": 0}', "'decode_gemv' must be bool, got 0"),
    ("--optimization-config", '{"kda_checkpoint_mode": "both"}',
     "'kda_checkpoint_mode' must be \"internal\" | \"split\", got \"both\""),
    ("--optimization-config", '{"kda_checkpoint_interval": 0}',
     "'kda_checkpoint_interval' must be int >= 1, got 0"),
    ("--optimization-config", '{"kda_checkpoint_interval": true}',
     "'kda_checkpoint_interval' must be int >= 1, got true"),
    ("--optimization-config", '{"num_kda_checkpoint_slots": -1}',
     "'num_kda_checkpoint_slots' must be int >= 0, got -1"),
    ("--optimization-config", '{"num_kda_checkpoint_slots": 1.5}',
     "'num_kda_checkpoint_slots' must be int >= 0, got 1.5"),
    ("--optimization-config", '["pdl"]', "expected a JSON object"),
    ("--optimization-config", '{pdl: false}', "not valid JSON"),
    ("--model-loader-extra-config", '{"dummy_routing": "random"}',
     "'dummy_routing' must be \"vllm\" | \"spread\", got \"random\""),
    ("--model-loader-extra-config", '{"load_format": "dummy"}',
     "unknown key 'load_format'; valid keys: dummy_routing"),
])
def test_bad_json_options_are_refused(option, value, match, capsys):
    with pytest.raises(SystemExit) as e:
        parse("/m", option, value)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"kdaserve serve: error: argument {option}: " in err and match in err


@pytest.mark.parametrize("flag", ["--decode-gemv", "--no-pdl", "--fused-router",
                                  "--router-splitk", "--kda-checkpoint-mode=split",
                                  "--no-adaptive-spec-budget", "--dummy-routing=spread"])
def test_removed_flags_are_gone(flag, capsys):
    with pytest.raises(SystemExit):
        parse("/m", flag)
    assert "unrecognized arguments" in capsys.readouterr().err


def test_kernel_config_reaches_the_worker(tmp_path):
    """The kernel switches reach the worker's KernelConfig; on the CPU every layer kind runs
    the reference backend whatever they say (same tokens). Which backend each switch picks on
    CUDA: tests/models/test_backends.py."""
    from kdaserve import LLM, SamplingParams
    from kdaserve.layers.backends import LayerBackends
    from kdaserve.models.make_model import make_model

    model = make_model(str(tmp_path / "tiny"), preset="tiny")
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = []
    for on in (False, True):
        llm = LLM(model, max_model_len=256, decode_gemv=on, pdl=on, fused_kda_decode=on,
                  mla_absorb_gemv=on, kda_state_prefetch=on, dense_mlp_gemv=on)
        worker = llm.llm_engine.engine_core.worker
        assert worker.kernel_config.pdl == on and worker.kernel_config.decode_gemv == on
        assert worker.backends == LayerBackends()
        assert worker.model.backends == LayerBackends()
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
