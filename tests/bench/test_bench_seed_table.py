# SPDX-License-Identifier: Apache-2.0
"""benchmarks/seed_table.py end to end on the CPU (tiny model, W5 sizes): a server per config,
results JSON per config, the summary table; plus a refused config."""

import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "seed_table.py")


@pytest.fixture(scope="module")
def seed_table():
    spec = importlib.util.spec_from_file_location("seed_table", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kdaserve.models.make_model import make_model

    return make_model(str(tmp_path_factory.mktemp("st") / "tiny"), "tiny")


def test_seed_table_cpu_smoke(seed_table, tiny_model, tmp_path, capsys):
    rc = seed_table.main([tiny_model, "--base-server-args", "--device cpu --max-num-seqs 4",
                          "--configs", "W1-nospec", "--input-len", "256", "--output-len", "16",
                          "--concurrency", "1,2", "--warmup", "1", "--time-budget", "240",
                          "--out-dir", str(tmp_path), "--tag", "t"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| kdaserve W1-nospec | 1 |" in out and "| vLLM 0.26.0 W1-nospec (ref) | 1 |" in out
    rec = json.loads((tmp_path / "seed_table_t_W1-nospec.json").read_text())
    assert rec["status"] == "ok" and rec["server_startup_s"] > 0
    assert [lv["concurrency"] for lv in rec["levels"]] == [1, 2]
    for lv in rec["levels"]:
        m = lv["metrics"]
        assert m["completed"] == 2 * lv["concurrency"] and m["failed"] == 0
        assert m["total_output_tokens"] == 16 * m["completed"]
        assert m["total_input_tokens"] == 256 * m["completed"]
        assert lv["duration_cap_s"] <= 150
    assert rec["config"]["temperature"] == 1.0 and rec["config"]["seed"] == 42
    summary = json.loads((tmp_path / "seed_table_t.json").read_text())
    assert summary["status"] == {"W1-nospec": "ok"} and "| config |" in summary["table_markdown"]


def test_refused_server_is_recorded(seed_table, tiny_model, tmp_path):
    rc = seed_table.main([tiny_model, "--base-server-args", "--device cpu --no-such-flag",
                          "--configs", "W1", "--input-len", "64", "--output-len", "4",
                          "--concurrency", "1", "--time-budget", "120", "--out-dir",
                          str(tmp_path), "--tag", "r"])
    assert rc == 1
    rec = json.loads((tmp_path / "seed_table_r_W1.json").read_text())
    assert rec["status"] == "refused" and "--no-such-flag" in rec["server_log_tail"]
    assert "--speculative-config" in rec["server_command"]


def test_table_rows_reference_layout(seed_table):
    level = {"concurrency": 4, "stopped_by": "num_requests",
             "metrics": {"completed": 8, "failed": 0, "mean_e2el_ms": 5000.0,
                         "output_throughput": 1274.2, "mean_ttft_ms": 400.0,
                         "mean_tpot_ms": 4.6, "median_itl_ms": 4.5},
             "server_counters": {"spec_decode_num_draft_tokens": 800.0,
                                 "spec_decode_num_accepted_tokens": 300.0,
                                 "spec_decode_acceptance_rate": 0.375}}
    rows = seed_table.table_rows([{"workload": "W1", "status": "ok", "levels": [level]}],
                                 [4], 8000, 1000, {4: (1000.0, 90.0, 44.4)})
    assert rows[0][:7] == ["kdaserve W1", "4", "5.00 s", "1274.2", "400.0 ms", "4.60 ms",
                           "4.50 ms"]
    assert "2.00x vLLM tok/s" in rows[0][7] and "spec acceptance 0.38" in rows[0][7]
    assert rows[1][0] == "vLLM 0.26.0 W1-nospec (ref)" and rows[1][3] == "637.1"
    assert rows[2][0].startswith("HF transformers+fla")
    assert rows[2][2] == f"{(1131 + 999 * 96) / 1000:.2f} s"
    assert rows[3][0] == "HF transformers (measured)" and rows[3][5] == "90.00 ms"


def test_w1_makes_a_drafter_of_the_spec_method(seed_table, tiny_model, tmp_path):
    """W1's --draft-model folder is made when missing, of the spec config's method: a DSpark
    drafter (speculators format) for "dspark", the small draft model otherwise."""
    for method, want in (("dspark", "dspark"), ("draft_model", None)):
        spec = {"method": method, "num_speculative_tokens": 4,
                "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.0}
        folder = str(tmp_path / method)
        args = seed_table.parse_args([tiny_model, "--configs", "W1", "--draft-model", folder,
                                      "--spec-config", json.dumps(spec)])
        flags = seed_table.server_args_for(args, "W1")
        assert json.loads(flags[flags.index("--speculative-config") + 1])["model"] == folder
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            assert json.load(f).get("speculators_model_type") == want
