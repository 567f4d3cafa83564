# SPDX-License-Identifier: Apache-2.0
"""benchmarks/ablation.py: the run matrix and each run's switch values (parsed by the real
`kdaserve serve` parser and SpeculativeConfig), then end to end on the CPU with the tiny model
(W1-shaped with ngram + synthetic acceptance, and W3-shaped with a cached shared prefix)."""

import argparse
import importlib.util
import json
import os
import sys

import pytest
import torch

from kdaserve.config import SpeculativeConfig
from kdaserve.entrypoints.openai import cli_args

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "ablation.py")
ALL = ["kda-checkpoint-mode", "adaptive-spec-budget", "kda-state-mode", "batch-layout",
       "draft-catchup", "sampling-threshold-kernel", "async-scheduling", "fused-kda-decode",
       "pdl", "decode-gemv"]
DECODE_SWITCHES = ["async-scheduling", "fused-kda-decode", "pdl", "decode-gemv"]
NGRAM = ('{"num_speculative_tokens": 8, "rejection_sample_method": "synthetic", '
         '"synthetic_acceptance_length": 4.0}')


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("ablation", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ablation"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("ablation", None)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kdaserve.models.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("abl") / "tiny"), "tiny")


def serve_kwargs(flags: list[str]) -> dict:
    """What `kdaserve serve` hands the engine for these flags."""
    p = argparse.ArgumentParser()
    cli_args.add_parser(p.add_subparsers())
    ns = p.parse_args(["serve", "/m", *flags])
    return cli_args.engine_kwargs_from_args(ns, "/m")


def switch_values(kwargs: dict) -> dict[str, object]:
    spec = kwargs.get("speculative_config") or {}
    return {"kda-checkpoint-mode": kwargs.get("kda_checkpoint_mode"),
            "adaptive-spec-budget": kwargs.get("adaptive_spec_budget"),
            "kda-state-mode": spec.get("kda_state_mode"),
            "batch-layout": spec.get("batch_layout"),
            "draft-catchup": spec.get("draft_catchup"),
            "sampling-threshold-kernel": kwargs.get("sampling_threshold_kernel"),
            "async-scheduling": kwargs.get("async_scheduling"),
            "fused-kda-decode": kwargs.get("fused_kda_decode"),
            "pdl": kwargs.get("pdl"), "decode-gemv": kwargs.get("decode_gemv")}


ON = {"kda-checkpoint-mode": "internal", "adaptive-spec-budget": True,
      "kda-state-mode": "recover", "batch-layout": "contiguous", "draft-catchup": "window",
      "sampling-threshold-kernel": True, **{s: True for s in DECODE_SWITCHES}}
OFF = {"kda-checkpoint-mode": "split", "adaptive-spec-budget": False,
       "kda-state-mode": "per_position", "batch-layout": "gather", "draft-catchup": "varlen",
       "sampling-threshold-kernel": False, **{s: False for s in DECODE_SWITCHES}}


def test_run_matrix(ablation):
    runs = ablation.run_matrix()
    assert [r.name for r in runs] == ["all-on", "all-off"] + [f"no-{s}" for s in ALL]
    assert list(ablation.SWITCH_NAMES) == ALL
    assert all(runs[0].switches.values()) and not any(runs[1].switches.values())
    for run, name in zip(runs[2:], ALL):
        assert [s for s, on in run.switches.items() if not on] == [name]
    picked = ablation.run_matrix(["no-batch-layout", "all-on"])
    assert [r.name for r in picked] == ["all-on", "no-batch-layout"]
    with pytest.raises(ValueError, match="no-shared-expert-fold"):
        ablation.run_matrix(["all-on", "no-shared-expert-fold"])


def test_each_run_passes_exactly_its_switch_values(ablation):
    spec = {"method": "ngram", "num_speculative_tokens": 8,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 4.0}
    base = ["--max-num-seqs", "4", "--no-enable-prefix-caching"]
    extra = {"kda_checkpoint_interval": 64}
    for run in ablation.run_matrix():
        flags, run_spec, run_opt = ablation.run_server_args(run, base, spec, extra)
        assert flags[:3] == base
        want = {s: ON[s] if on else OFF[s] for s, on in run.switches.items()}
        kwargs = serve_kwargs(flags)
        assert switch_values(kwargs) == want, run.name
        assert kwargs["speculative_config"] == run_spec
        assert kwargs["kda_checkpoint_interval"] == 64 and run_opt["kda_checkpoint_interval"] == 64
        assert {k: kwargs[k] for k in run_opt} == run_opt
        assert {k: v for k, v in run_spec.items()
                if k not in ("kda_state_mode", "batch_layout", "draft_catchup")} == spec
        sc = SpeculativeConfig(**run_spec)  # the engine accepts it
        assert (sc.kda_state_mode, sc.batch_layout, sc.draft_catchup) == (
            want["kda-state-mode"], want["batch-layout"], want["draft-catchup"])
        assert flags.count("--speculative-config") == flags.count("--optimization-config") == 1
    # Without a speculative config the spec keys go nowhere; the other switches still do.
    flags, run_spec, _ = ablation.run_server_args(ablation.run_matrix(["all-off"])[0], [], None)
    assert run_spec is None and "--speculative-config" not in flags
    values = switch_values(serve_kwargs(flags))
    assert values["kda-checkpoint-mode"] == "split"
    assert [values[s] for s in DECODE_SWITCHES] == [False] * 4


def test_auto_runs_follow_the_workload(ablation, tmp_path):
    w1 = ablation.parse_args(["/m", "--out-dir", str(tmp_path)])
    assert [r.name for r in w1.run_list] == ["all-on", "all-off", "no-adaptive-spec-budget",
                                             "no-kda-state-mode", "no-batch-layout",
                                             "no-sampling-threshold-kernel",
                                             "no-fused-kda-decode", "no-pdl", "no-decode-gemv"]
    assert w1.spec["method"] == "ngram" and (w1.input_len, w1.output_len) == (8000, 1000)
    assert w1.concurrency == (1, 4, 16) and not w1.prefix_caching
    w1d = ablation.parse_args(["/m", "--draft-model", "/d", "--runs", "all"])
    assert w1d.spec["method"] == "draft_model" and w1d.spec["model"] == "/d"
    auto_d = ablation.parse_args(["/m", "--draft-model", "/d"])
    assert [r.name for r in auto_d.run_list] == [
        "all-on", "all-off", "no-adaptive-spec-budget", "no-kda-state-mode", "no-batch-layout",
        "no-draft-catchup", "no-sampling-threshold-kernel", "no-async-scheduling",
        "no-pdl"]  # every step verifies; the draft model's steps overlap
    assert len(w1d.run_list) == 12 and w1d.out_dir.startswith(ablation.RESULTS_DIR)
    nospec = ablation.parse_args(["/m", "--spec-method", "none"])
    assert nospec.spec is None and [r.name for r in nospec.run_list] == [
        "all-on", "all-off", "no-sampling-threshold-kernel",
        *(f"no-{s}" for s in DECODE_SWITCHES)]
    w3 = ablation.parse_args(["/m", "--workload", "W3"])
    assert w3.spec is None and w3.prefix_caching and w3.shared_prefix_len == 7680
    assert [r.name for r in w3.run_list] == ["all-on", "all-off", "no-kda-checkpoint-mode",
                                             "no-sampling-threshold-kernel",
                                             *(f"no-{s}" for s in DECODE_SWITCHES)]
    assert "--enable-prefix-caching" in ablation.base_flags(w3)


@pytest.mark.parametrize("argv,match", [
    (["--server-args=--no-async-scheduling"], "set by the driver"),
    (["--base-server-args", "--max-num-seqs 4 --optimization-config {}"], "set by the driver"),
    (["--server-args=--optimization-config={}"], "set by the driver"),
    (["--optimization-config", '{"pdl": false}'], "switch keys"),
    (["--optimization-config", '{"fused_router": true}'], "unknown key 'fused_router'"),
    (["--base-server-args", "--speculative-config {}"], "set by the driver"),
    (["--spec-config", '{"batch_layout": "gather"}'], "switch keys"),
    (["--spec-method", "draft_model"], "needs --draft-model"),
    (["--runs", "all-on,no-moe-finalize"], "no-moe-finalize"),
    (["--shared-prefix-len", "9000"], "shared-prefix-len"),
])
def test_bad_arguments_are_refused(ablation, argv, match, capsys):
    with pytest.raises(SystemExit):
        ablation.parse_args(["/m", *argv])
    assert match in capsys.readouterr().err


def test_plan_requests_scales_counts_not_lengths(ablation):
    assert ablation.plan_requests(32, 16, 100.0, None) == 32
    assert ablation.plan_requests(32, 16, 100.0, 40.0) == 32  # 2 rounds fit
    assert ablation.plan_requests(32, 16, 100.0, 60.0) == 16  # 1 round fits
    assert ablation.plan_requests(32, 16, 10.0, 60.0) == 16   # never below one round
    assert ablation.plan_requests(8, 4, 50.0, 10.0) == 8


def test_summary_rows_compare_with_all_on(ablation):
    def rec(run, tok):
        m = {"output_throughput": tok, "mean_ttft_ms": 10.0, "mean_tpot_ms": 2.0,
             "completed": 2, "failed": 0}
        return {"run": run, "status": "ok", "levels": [
            {"concurrency": 1, "metrics": m, "server_counters": {
                "spec_decode_num_draft_tokens": 10.0, "spec_decode_acceptance_rate": 0.3}},
            {"concurrency": 4, "skipped": "time budget"}]}

    rows = ablation.summary_rows([rec("all-on", 200.0), rec("no-batch-layout", 150.0)])
    assert "vs_all_on" not in rows[0] and rows[2]["vs_all_on"] == pytest.approx(-0.25)
    assert rows[1]["status"] == rows[3]["status"] == "time budget"
    table = ablation.format_markdown(rows)
    assert "| no-batch-layout | 1 | 150.0 | -25.0% | 10.0 ms | 2.00 ms |" in table
    assert "acceptance rate 0.30" in table


def check_run(out_dir, run: str, want: dict, levels: list[int], n_out: int) -> dict:
    rec = json.loads((out_dir / f"{run}.json").read_text())
    assert rec["status"] == "ok" and rec["run"] == run and rec["server_startup_s"] > 0
    assert {s: v.get("value", v.get("server_flags")) for s, v in rec["switches"].items()} == want
    assert [lv["concurrency"] for lv in rec["levels"]] == levels
    for lv in rec["levels"]:
        m = lv["metrics"]
        assert m["completed"] == 2 * lv["concurrency"] and m["failed"] == 0
        assert m["total_output_tokens"] == n_out * m["completed"]
        assert m["output_throughput"] > 0 and 0 < m["mean_ttft_ms"] < m["mean_e2el_ms"]
    assert rec["commit"] and "ablation.py" in rec["command"]
    return rec


def test_w1_shaped_cpu_end_to_end(ablation, tiny_model, tmp_path, capsys):
    rc = ablation.main([tiny_model, "--device", "cpu", "--base-server-args", "--max-num-seqs 4",
                        "--spec-method", "ngram", "--spec-config", NGRAM,
                        "--input-len", "64", "--output-len", "8", "--concurrency", "1,2",
                        "--warmup", "1", "--runs", "all-on,no-kda-state-mode",
                        "--time-budget", "150", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    on = {**ON, "async-scheduling": ["--async-scheduling"]}
    rec = check_run(tmp_path, "all-on", on, [1, 2], 8)
    assert rec["speculative_config"]["kda_state_mode"] == "recover"
    assert rec["switches"]["batch-layout"]["exercised"]
    assert not rec["switches"]["kda-checkpoint-mode"]["exercised"]
    assert not rec["switches"]["async-scheduling"]["exercised"]  # spec: one step at a time
    assert rec["switches"]["fused-kda-decode"]["exercised"]      # ngram: plain decode steps
    assert rec["optimization_config"]["pdl"] is True
    assert json.loads(rec["server_flags"][rec["server_flags"].index("--optimization-config")
                                          + 1]) == rec["optimization_config"]
    off = check_run(tmp_path, "no-kda-state-mode", {**on, "kda-state-mode": "per_position"},
                    [1, 2], 8)
    assert '"kda_state_mode": "per_position"' in off["server_command"]
    for r, mode in ((rec, "recover"), (off, "per_position")):   # capacity per state mode
        cap = r["server_capacity"]
        assert cap["kv_cache_tokens"] > 0 and cap["kda_state_slots"] > 0, cap
        assert f"KDA state {mode}" in cap["spec_state_memory"], cap
        counters = r["levels"][-1]["server_counters"]
        if counters["spec_decode_num_drafts"]:
            assert counters["spec_decode_kda_state_bytes_per_verify"] > 0, counters
    assert off["levels"][0]["server_counters"]["spec_decode_num_draft_tokens"] >= 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["runs"]) == ["all-on", "no-kda-state-mode"]
    assert summary["runs"]["no-kda-state-mode"]["switches"]["kda-state-mode"] is False
    assert [(r["run"], r["concurrency"]) for r in summary["rows"]] == [
        ("all-on", 1), ("all-on", 2), ("no-kda-state-mode", 1), ("no-kda-state-mode", 2)]
    assert "| no-kda-state-mode | 2 |" in out


def test_w3_shaped_cpu_checkpoint_switch(ablation, tiny_model, tmp_path):
    rc = ablation.main([tiny_model, "--workload", "W3", "--device", "cpu",
                        "--base-server-args", "--max-num-seqs 4",
                        "--optimization-config", '{"kda_checkpoint_interval": 64}',
                        "--input-len", "192", "--shared-prefix-len", "128", "--output-len", "4",
                        "--warmup", "1", "--time-budget", "120", "--out-dir", str(tmp_path),
                        "--runs", "no-kda-checkpoint-mode"])
    assert rc == 0
    rec = check_run(tmp_path, "no-kda-checkpoint-mode", {
        **ON, "kda-checkpoint-mode": "split", "async-scheduling": ["--async-scheduling"],
        "kda-state-mode": None, "batch-layout": None, "draft-catchup": None}, [1], 4)
    assert rec["optimization_config"]["kda_checkpoint_interval"] == 64
    assert rec["speculative_config"] is None and rec["switches"]["kda-checkpoint-mode"]["exercised"]
    assert all(rec["switches"][s]["exercised"] for s in DECODE_SWITCHES)
    assert "--enable-prefix-caching" in rec["server_flags"]
    counters = rec["levels"][0]["server_counters"]
    assert counters["prefix_cache_hits"] > 0


def test_make_draft_model_takes_the_target_vocabulary(ablation, tiny_model, tmp_path):
    import shutil

    from kdaserve.config.model_args import KimiLinearArgs
    from kdaserve.spec_decode.draft_model import DraftModelProposer

    target = tmp_path / "target"
    shutil.copytree(tiny_model, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["vocab_size"] = 4096  # unlike the small preset's
    (target / "config.json").write_text(json.dumps(cfg))
    from kdaserve.models.make_model import make_draft_model

    draft = make_draft_model(str(target), str(tmp_path / "draft"))
    dcfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert dcfg["vocab_size"] == 4096 and dcfg["hidden_size"] != cfg["hidden_size"]
    proposer = DraftModelProposer.from_pretrained(
        draft, KimiLinearArgs.from_hf_config(cfg), num_speculative_tokens=2, max_num_seqs=1,
        max_model_len=64, block_size=16, dtype=torch.float32, device="cpu")
    assert proposer.args.vocab_size == 4096
