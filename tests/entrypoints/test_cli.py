# SPDX-License-Identifier: Apache-2.0
"""`kdaserve serve` / `kdaserve generate` command lines: vLLM flag names and meanings, clear
start-up errors, the embedded default model."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import httpx
import pytest

import kdaserve
from kdaserve.entrypoints.cli import build_parser
from kdaserve.entrypoints.openai import cli_args
from kdaserve.entrypoints.openai.cli_args import (check_server_args, engine_kwargs_from_args,
                                                  human_int)
from tests.entrypoints.conftest import REPO, RemoteServer, free_port


def parse(*argv):
    return build_parser("serve").parse_args(["serve", *argv])


@pytest.mark.parametrize("text,value", [("4096", 4096), ("32k", 32000), ("32K", 32768),
                                        ("1m", 10**6), ("1M", 2**20), ("25.6k", 25600),
                                        ("auto", None), ("-1", None)])
def test_human_int(text, value):
    assert human_int(text) == value


@pytest.mark.parametrize("text", ["abc", "12q", "0", "1.5K", ""])
def test_human_int_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_int(text)


def test_serve_flags_map_to_engine_kwargs():
    args = parse("/m", "--max-model-len", "8k", "--max-num-seqs", "32",
                 "--max-num-batched-tokens", "2048", "--block-size", "32",
                 "--gpu-memory-utilization", "0.8", "--enforce-eager", "--load-format", "dummy",
                 "-tp", "1", "--no-enable-prefix-caching", "--dtype", "float32", "--seed", "3",
                 "-sc", '{"method": "ngram", "num_speculative_tokens": 3}',
                 "--num-gpu-blocks-override", "100", "--device", "cpu", "--trust-remote-code")
    assert engine_kwargs_from_args(args, "/m") == {
        "model": "/m", "max_model_len": 8000, "max_num_seqs": 32,
        "max_num_batched_tokens": 2048, "block_size": 32, "gpu_memory_utilization": 0.8,
        "enforce_eager": True, "load_format": "dummy", "tensor_parallel_size": 1,
        "enable_prefix_caching": False, "dtype": "float32", "seed": 3,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
        "num_gpu_blocks": 100, "device": "cpu"}
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    # unset flags are not passed: the engine's defaults apply
    assert engine_kwargs_from_args(parse("/m"), "/m") == {"model": "/m"}
    assert parse("/m", "--enable-prefix-caching").enable_prefix_caching is True


def test_offload_flags_map_to_engine_kwargs(capsys):
    args = parse("/m", "--kv-offload-size", "2.5", "--additional-config",
                 '{"kv_offload_disk_path": "/d", "kv_offload_disk_size": 8}')
    assert engine_kwargs_from_args(args, "/m") == {
        "model": "/m", "kv_offload_size": 2.5, "kv_offload_disk_path": "/d",
        "kv_offload_disk_size": 8}
    assert parse("/m", "--kv-offloading-size", "1").kv_offload_size == 1.0   # vLLM's name
    for bad in (["--kv-offload-size", "-1"], ["--kv-offload-size", "lots"],
                ["--additional-config", '{"kv_offload_disk_path": ""}']):
        with pytest.raises(SystemExit):
            parse("/m", *bad)


@pytest.mark.parametrize("argv", [["--reasoning-parser", "deepseek_r9"],
                                  ["--tool-call-parser", "hermes"],
                                  ["--load-format", "pt"], ["--max-model-len", "lots"],
                                  ["-sc", "{not json"], ["--max-num-seqs", "0"]])
def test_unknown_values_are_rejected(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse("/m", *argv)
    assert e.value.code == 2
    assert "error: argument" in capsys.readouterr().err


MAX_SERVE_OPTIONS = 35
"""Issue 18's bound: `kdaserve serve --help` shows what a user tunes, at most 35 options; the
ablation baselines are keys of --optimization-config, not top-level flags."""


def serve_parser() -> argparse.ArgumentParser:
    return cli_args.add_parser(argparse.ArgumentParser(prog="kdaserve").add_subparsers())


LAUNCH_FLAGS = {"--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless",
                "--decode-context-parallel-size"}
"""Where the ranks run and how they split the KV (issue 23 asks for vLLM's multi-node and
decode-context-parallel flags by name): the launch topology, not knobs a user tunes, so outside
issue 18's bound."""


NAMED_FLAGS = {"--kv-offload-size"}
"""Top-level flags a later issue asks for by name (issue 24: `--kv-offload-size`, vLLM's
`--kv-offloading-size`), outside issue 18's bound like the launch flags."""


def serve_options() -> list[argparse.Action]:
    """The options of `kdaserve serve` (a --x / --no-x pair is one), less -h and MODEL."""
    return [a for a in serve_parser()._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_the_launch_flags_are_serve_options():
    flags = {f for a in serve_options() for f in a.option_strings}
    assert LAUNCH_FLAGS | NAMED_FLAGS <= flags


def test_serve_lists_at_most_35_options():
    options = [a for a in serve_options()
               if not set(a.option_strings) & (LAUNCH_FLAGS | NAMED_FLAGS)]
    assert len(options) <= MAX_SERVE_OPTIONS, (
        f"`kdaserve serve --help` lists {len(options)} options, more than issue 18's bound of "
        f"{MAX_SERVE_OPTIONS}: group new knobs into a JSON option (--optimization-config) "
        f"instead of top-level flags")


def test_configuration_doc_covers_every_option_and_key():
    """docs/configuration.md documents every serve option and every key of the JSON options
    (the key tables of cli_args and SpeculativeConfig are the sources)."""
    import dataclasses

    from kdaserve.config import SpeculativeConfig

    with open(os.path.join(REPO, cli_args.DOCS)) as f:
        doc = f.read()
    for action in serve_options():
        for flag in action.option_strings:
            assert f"`{flag}" in doc, flag
    rows = {line.split("|")[1].strip(): line for line in doc.splitlines()
            if line.startswith("| `")}
    for keys in (cli_args.OPTIMIZATION_CONFIG_KEYS, cli_args.MODEL_LOADER_EXTRA_CONFIG_KEYS,
                 cli_args.ADDITIONAL_CONFIG_KEYS):
        for key, kind in keys.items():
            assert f"`{key}`" in rows and kind.name.replace("|", "\\|") in rows[f"`{key}`"], key
    for field in dataclasses.fields(SpeculativeConfig):
        if field.init:
            assert f"`{field.name}`" in rows, field.name


def test_json_option_keys_are_engine_kwargs():
    """Each --optimization-config / --model-loader-extra-config key is a field of the engine
    config that LLMEngine.from_engine_args routes it to, and every kernel switch has a key."""
    import dataclasses

    from kdaserve.config import CacheConfig, KernelConfig, LoadConfig, SchedulerConfig

    def names(*classes):
        return {f.name for c in classes for f in dataclasses.fields(c)}

    assert set(cli_args.OPTIMIZATION_CONFIG_KEYS) <= names(CacheConfig, SchedulerConfig,
                                                           KernelConfig)
    assert names(KernelConfig) <= set(cli_args.OPTIMIZATION_CONFIG_KEYS)
    assert set(cli_args.MODEL_LOADER_EXTRA_CONFIG_KEYS) <= names(LoadConfig)


def test_auto_tool_choice_needs_a_parser():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        check_server_args(parse("/m", "--enable-auto-tool-choice"))
    check_server_args(parse("/m", "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2"))


def _run_cli(*argv, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "kdaserve.entrypoints.cli", *argv],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="2",
                                   **(env or {})))


def test_indivisible_tensor_parallel_is_a_startup_error(tiny_model):
    """The tiny model's 2 KDA heads do not split over 3 ranks: named, before any rank runs."""
    r = _run_cli("serve", tiny_model, "--tensor-parallel-size", "3", "--port", "1")
    assert r.returncode == 2
    assert "linear_num_heads (KDA heads)=2 is not divisible by tensor_parallel_size=3" in r.stderr


def test_missing_model_folder_is_a_startup_error(tmp_path):
    """Reported as missing, in one line without a traceback, before the engine starts."""
    r = _run_cli("serve", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"kdaserve serve: error: model folder {str(tmp_path / 'nope')!r} does not exist"]
    (tmp_path / "empty").mkdir()
    r = _run_cli("serve", str(tmp_path / "empty"), "--port", str(free_port()))
    assert r.returncode == 2 and "has no config.json" in r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout


def test_port_in_use_is_a_startup_error(tiny_model):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _run_cli("serve", tiny_model, "--port", str(port), timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"kdaserve serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert "starting the engine" not in r.stderr + r.stdout  # refused before the engine loads


def test_version_and_help_text():
    r = _run_cli("--version", timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"kdaserve {kdaserve.__version__}"
    text = serve_parser().format_help()
    assert "Address to listen on (default: 127.0.0.1" in " ".join(text.split())
    assert "Port to listen on (default: 8000)" in " ".join(text.split())
    for action in serve_options():
        assert action.help, f"{action.option_strings} has no help text"


def test_additional_config_keys_are_checked(capsys):
    args = parse("/m", "--additional-config", '{"num_state_slots": 12, "max_n_sequences": 4}')
    assert args.additional_config == {**cli_args.ADDITIONAL_CONFIG_DEFAULTS,
                                      "num_state_slots": 12, "max_n_sequences": 4}
    assert engine_kwargs_from_args(args, "/m") == {"model": "/m", "num_state_slots": 12}
    # every key the server reads has a default; the lifecycle keys pass through untouched
    assert parse("/m").additional_config == cli_args.ADDITIONAL_CONFIG_DEFAULTS
    assert {"graceful_shutdown_timeout", "stream_buffer_limit"} <= set(
        cli_args.ADDITIONAL_CONFIG_DEFAULTS)
    for bad, message in [('{"bogus": 1}', "unknown key 'bogus'"),
                         ('{"max_n_sequences": 0}', "'max_n_sequences' must be int >= 1"),
                         ('{"engine_startup_timeout": "soon"}', "must be float > 0"),
                         ('{"mirror_reasoning_content": 1}', "must be bool"),
                         ('{"allowed_hosts": "a.example"}', "must be list of strings"),
                         ("[1]", "expected a JSON object")]:
        with pytest.raises(SystemExit):
            parse("/m", "--additional-config", bad)
        err = capsys.readouterr().err
        assert "argument --additional-config" in err and message in err, err
    # `kdaserve generate` takes only the engine keys
    gen = build_parser("generate")
    assert gen.parse_args(["generate", "-p", "x", "--additional-config",
                           '{"num_state_slots": 3}']).additional_config == {"num_state_slots": 3}
    with pytest.raises(SystemExit):
        gen.parse_args(["generate", "-p", "x", "--additional-config",
                        '{"max_request_body_bytes": 3}'])


def test_api_key_from_the_environment(monkeypatch):
    from kdaserve.entrypoints.openai.cli_args import resolve_api_key

    monkeypatch.delenv("KDASERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert resolve_api_key(parse("/m")) is None
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert resolve_api_key(parse("/m")) == "v"
    monkeypatch.setenv("KDASERVE_API_KEY", "k")
    assert resolve_api_key(parse("/m")) == "k"
    assert resolve_api_key(parse("/m", "--api-key", "flag")) == "flag"


def test_generate_takes_the_engine_options():
    args = build_parser("generate").parse_args([
        "generate", "/m", "-p", "hi", "--optimization-config", '{"pdl": false}',
        "--model-loader-extra-config", '{"dummy_routing": "spread"}', "--no-async-scheduling"])
    assert engine_kwargs_from_args(args, "/m") == {
        "model": "/m", "pdl": False, "dummy_routing": "spread", "async_scheduling": False}


def test_generate_cli(tiny_model):
    r = _run_cli("generate", tiny_model, "-p", "hello there", "-p", "second", "--max-tokens",
                 "5", "--ignore-eos", "--json", "--max-model-len", "256")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["prompt"] for row in rows] == ["hello there", "second"]
    assert all(len(row["outputs"][0]["token_ids"]) == 5 for row in rows)
    assert all(row["outputs"][0]["finish_reason"] == "length" for row in rows)


def test_serve_without_model_uses_the_embedded_default(tmp_path):
    """Served under the short name of its folder; the cache path is not shown to clients (and
    is still accepted as the model name)."""
    srv = RemoteServer(["--max-model-len", "256"], env={"KDASERVE_CACHE": str(tmp_path)})
    try:
        card = httpx.get(srv.url + "/v1/models").json()["data"][0]
        path = os.path.join(str(tmp_path), "tiny-kimi-linear")
        assert card["id"] == card["root"] == "tiny-kimi-linear"
        assert os.path.isfile(os.path.join(path, "config.json"))
        r = srv.client().completions.create(model=card["id"], prompt="hi", max_tokens=3)
        assert r.usage.completion_tokens >= 1
        assert srv.client().completions.create(model=path, prompt="hi", max_tokens=1).model == (
            path)
        assert str(tmp_path) not in httpx.get(srv.url + "/metrics").text
    finally:
        srv.stop()
    assert srv.proc.returncode == 0, srv.logs()
