# SPDX-License-Identifier: Apache-2.0
"""`kdaserve bench serve` end to end against the fake streaming server (known schedule)."""

import json

import pytest

from kdaserve.entrypoints.cli import main


def run_cli(server, tmp_path, *extra, name="r"):
    out, png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    rc = main(["bench", "serve", "--base-url", server.base_url, "--out", str(out),
               "--plot", str(png), "--seed", "7", *extra])
    result = json.loads(out.read_text()) if out.exists() else None
    return rc, result, png


def test_chat_run_metrics_and_outputs(fake_server, tmp_path, capsys):
    rc, res, png = run_cli(fake_server, tmp_path, "--input-len", "64", "--output-len", "8",
                           "--concurrency", "1,4", "--warmup", "1", "--label", "fake",
                           "--server-flags", "--max-num-seqs 4", "--temperature", "1.0",
                           "--top-p", "0.95", "--save-detailed")
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT mean ms" in capsys.readouterr().out
    assert res["label"] == "fake" and res["server"]["server_flags"] == "--max-num-seqs 4"
    assert res["server"]["models"]["data"][0]["id"] == "fake-model"
    assert res["config"]["chat_template_tokens"] == 7
    assert res["config"]["content_prompt_len"] == 64 - 7
    assert res["gpu"] and "commit" in res
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 4]
    cfg = fake_server.cfg
    for lv in res["levels"]:
        m, n = lv["metrics"], 2 * lv["concurrency"]
        assert m["completed"] == n and m["failed"] == 0 and len(lv["requests"]) == n
        assert len(lv["warmup_requests"]) == 1
        assert m["total_output_tokens"] == 8 * n and m["total_input_tokens"] == 64 * n
        assert lv["prompt_tokens_match_rate"] == 1.0
        assert cfg.ttft_s <= m["mean_ttft_ms"] / 1000 < m["mean_e2el_ms"] / 1000
        assert m["mean_tpot_ms"] >= cfg.itl_s * 1000 * 7 / 7 * 0.9
        assert m["max_concurrent_requests"] == lv["concurrency"]
        for r in lv["requests"]:
            assert r["success"] and r["output_tokens_source"] == "usage"
            assert r["output_tokens"] == 8 and r["prompt_tokens"] == 64
            assert r["ttft"] >= cfg.ttft_s and r["ttft"] < r["latency"] <= r["request_end"]
            assert len(r["itl"]) == 8  # role chunk + 8 token events
            assert sum(r["event_tokens"]) == 8
            assert r["finish_reason"] == "length"
        g = lv["guidellm"]
        assert g["request_totals"]["successful"] == n
        assert g["time_to_first_token_ms"]["mean"] >= cfg.ttft_s * 1000
        assert g["inter_token_latency_ms"]["mean"] == pytest.approx(m["mean_tpot_ms"], rel=0.2)
        assert g["time_per_output_token_ms"]["mean"] > g["inter_token_latency_ms"]["mean"]
    assert fake_server.state.peak_active == 4
    body = fake_server.state.bodies[-1]
    assert body["ignore_eos"] is True and body["max_completion_tokens"] == 8
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["temperature"] == 1.0 and body["top_p"] == 0.95 and body["model"] == "fake-model"
    # probe + 2 levels x (warm-up + measured); all prompts distinct
    contents = [b["messages"][0]["content"] for b in fake_server.state.bodies]
    assert len(contents) == 1 + (1 + 2) + (1 + 8) and len(set(contents)) == len(contents)


def test_requests_keep_scalars_without_save_detailed(fake_server, tmp_path):
    rc, res, _ = run_cli(fake_server, tmp_path, "--input-len", "32", "--output-len", "6",
                         "--concurrency", "2", "--num-requests", "2", "--warmup", "1")
    assert rc == 0
    lv = res["levels"][0]
    for r in lv["requests"] + lv["warmup_requests"]:
        assert not {"itl", "event_times", "event_tokens"} & r.keys()
        assert r["success"] and r["output_tokens"] == 6 and r["num_events"] == 7
        assert r["tpot"] is not None and r["ttft"] < r["latency"]
    assert lv["metrics"]["completed"] == 2 and lv["metrics"]["mean_itl_ms"] > 0


def test_completions_token_ids_multi_token_events(fake_server, tmp_path):
    fake_server.cfg.tokens_per_event = 3
    rc, res, _ = run_cli(fake_server, tmp_path, "--endpoint", "completions", "--token-ids",
                         "--input-len", "100", "--output-len", "10", "--concurrency", "2",
                         "--num-requests", "3", "--warmup", "0", "--save-detailed")
    assert rc == 0
    lv = res["levels"][0]
    assert lv["metrics"]["completed"] == 3 and res["config"]["chat_template_tokens"] is None
    for r in lv["requests"]:
        assert r["prompt_tokens"] == 100 and r["output_tokens"] == 10
        assert r["event_tokens"] == [3, 3, 3, 1] and len(r["itl"]) == 3
    assert lv["guidellm"]["output_tokens_per_iteration"]["mean"] == pytest.approx(2.5)
    assert all(isinstance(b["prompt"], list) and len(b["prompt"]) == 100
               for b in fake_server.state.bodies)


def test_content_mode_and_no_ignore_eos(fake_server, tmp_path):
    rc, res, _ = run_cli(fake_server, tmp_path, "--input-len", "40", "--output-len", "6",
                         "--concurrency", "1", "--warmup", "0", "--prompt-len-mode", "content",
                         "--no-ignore-eos")
    assert rc == 0
    for r in res["levels"][0]["requests"]:
        assert r["prompt_len"] == 40 and r["prompt_tokens"] == 47
        assert r["output_tokens"] == 3 and r["finish_reason"] == "stop"
    assert "ignore_eos" not in fake_server.state.bodies[-1]


@pytest.mark.parametrize("mode,match", [("http", "HTTP 500"), ("stream", "stream error")])
def test_failed_requests_are_counted(fake_server, tmp_path, mode, match):
    # The probe must succeed, so failures are injected on the completions endpoint.
    rc, res, png = run_cli(fake_server, tmp_path, "--endpoint", "completions", "--input-len",
                           "16", "--output-len", "4", "--concurrency", "2", "--warmup", "0",
                           "--extra-body", json.dumps({"fake_fail": mode}))
    assert rc == 0 and png.exists()
    lv = res["levels"][0]
    assert lv["metrics"]["completed"] == 0 and lv["metrics"]["failed"] == 4
    assert all(match in r["error"] and not r["success"] for r in lv["requests"])


def test_duration_caps_a_level(fake_server, tmp_path):
    fake_server.cfg.itl_s = 0.02
    rc, res, _ = run_cli(fake_server, tmp_path, "--endpoint", "completions", "--input-len",
                         "8", "--output-len", "10", "--concurrency", "1", "--warmup", "0",
                         "--num-requests", "100", "--duration", "0.5")
    assert rc == 0
    lv = res["levels"][0]
    assert lv["stopped_by"] == "duration"
    assert 1 <= lv["num_requests_sent"] < 10
    assert lv["metrics"]["completed"] == lv["num_requests_sent"]


def test_bad_input_and_unreachable_server(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--concurrency", "0,2"])
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--timeout", "2"])
    assert rc == 2 and "ConnectError" in capsys.readouterr().err
    rc = main(["bench", "serve", "--token-ids"])
    assert rc == 2 and "--token-ids needs --endpoint completions" in capsys.readouterr().err


def test_help_documents_flags(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--help"])
    text = capsys.readouterr().out
    for flag in ["--base-url", "--model", "--tokenizer", "--endpoint", "--input-len",
                 "--output-len", "--concurrency", "--num-requests", "--duration", "--warmup",
                 "--seed", "--temperature", "--top-p", "--token-ids", "--ignore-eos",
                 "--api-key", "--extra-body", "--label", "--out", "--plot", "--server-flags",
                 "--timeout", "--shared-prefix-len", "TPOT", "ITL", "guidellm"]:
        assert flag in text


def test_level_timeout_cancels_running_requests(fake_server, tmp_path):
    fake_server.cfg.itl_s = 0.05  # 40 tokens: ~2 s per request
    rc, res, _ = run_cli(fake_server, tmp_path, "--endpoint", "completions", "--input-len",
                         "8", "--output-len", "40", "--concurrency", "2", "--warmup", "0",
                         "--level-timeout", "0.5")
    assert rc == 0
    lv = res["levels"][0]
    assert lv["stopped_by"] == "level_timeout"
    assert lv["metrics"]["completed"] == 0 and lv["metrics"]["failed"] == 2
    assert all("level-timeout" in r["error"] for r in lv["requests"])
    assert lv["metrics"]["duration_s"] < 1.5
