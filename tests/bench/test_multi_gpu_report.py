# SPDX-License-Identifier: Apache-2.0
"""benchmarks/multi_gpu_report.py: the pytest summary, the merged engine runs and the guidellm
levels (a report shaped as guidellm 0.8.1 writes it) next to the seed's reference rows."""

import json

import pytest

LOG = """\
tests/distributed/test_dcp_engine.py::test_dcp2_cuda_graphs_equal_tp1_gpu PASSED       [ 50%]
tests/distributed/test_tp_server.py::test_other_gpu FAILED                              [100%]
=================== 1 failed, 1 passed, 58 deselected in 81.20s ===================
"""


@pytest.fixture(scope="module")
def rep(load_benchmark):
    return load_benchmark("multi_gpu_report")


def _stat(mean, median=None):
    return {"successful": {"mean": mean, "median": mean if median is None else median}}


def _guidellm(streams, errored=0):
    metrics = {"request_totals": {"successful": 8, "errored": errored, "incomplete": 1,
                                  "total": 9},
               "request_latency": _stat(5.5), "output_tokens_per_second": _stat(190.0),
               "time_to_first_token_ms": _stat(400.0), "inter_token_latency_ms": _stat(5.1),
               "output_tokens_per_iteration": _stat(3.9)}
    return {"metadata": {"guidellm_version": "0.8.1"}, "config": {"spec": {}},
            "benchmarks": [{"config": {"strategy": {"streams": streams}}, "duration": 150.0,
                            "metrics": metrics}]}


def test_tests_merge_and_guidellm(rep, tmp_path):
    log = tmp_path / "t.log"
    log.write_text(LOG)
    assert rep.main(["tests", str(log), str(tmp_path / "t.json")]) == 0
    t = json.loads((tmp_path / "t.json").read_text())
    assert t["counts"] == {"failed": 1, "passed": 1, "deselected": 58} and not t["ok"]
    assert rep.tests_report(LOG.replace("FAILED", "PASSED").replace("1 failed, ", ""))["ok"]
    assert not rep.tests_report(LOG.replace("PASSED", "SKIPPED").split("tests/distributed/test_tp")[0]
                                + "== 1 skipped, 58 deselected in 2.0s ==")["ok"]   # no GPU test ran
    assert t["tests"]["tests/distributed/test_tp_server.py::test_other_gpu"] == "FAILED"
    assert "commit" in t and "gpu" in t and "command" in t

    (tmp_path / "a.json").write_text(json.dumps({"kv_cache_tokens": 5}))
    rep.main(["merge", str(tmp_path / "m.json"), f"tp1={tmp_path / 'a.json'}",
              f"tp2={tmp_path / 'missing.json'}"])
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["runs"]["tp1"] == {"kv_cache_tokens": 5}
    assert m["runs"]["tp2"]["status"] == "missing"

    dirs = []
    for streams in (16, 1):
        d = tmp_path / f"c{streams}"
        d.mkdir()
        (d / "guidellm.json").write_text(json.dumps(_guidellm(streams, errored=int(streams > 1))))
        dirs.append(str(d))
    server_log = tmp_path / "server.log"
    server_log.write_text("INFO MLA KV cache: 1234 tokens; KDA state slots: 8 (0.1 GiB); "
                          "max concurrency at max_model_len: 1.00\n")
    rep.main(["guidellm", str(tmp_path / "g.json"), *dirs, str(tmp_path / "none"),
              "--server-log", str(server_log), "--server-command", "kdaserve serve X"])
    g = json.loads((tmp_path / "g.json").read_text())
    assert [lv["streams"] for lv in g["levels"]] == [1, 16]
    assert g["levels"][0] == {"streams": 1, "duration_s": 150.0, "successful": 8, "errored": 0,
                              "incomplete": 1, "mean_latency_s": 5.5, "output_tok_s": 190.0,
                              "mean_ttft_ms": 400.0, "median_itl_ms": 5.1,
                              "output_tokens_per_iteration": 3.9}
    assert g["levels"][1]["errored"] == 1
    assert g["runs"][-1]["status"] == "no guidellm.json"
    assert g["server_capacity"]["kv_cache_tokens"] == 1234
    assert g["reference"]["optimised"]["16"]["output_tok_s"] == 725.0
    assert g["server_command"] == "kdaserve serve X"
