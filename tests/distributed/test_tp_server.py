"""`kdaserve serve --tensor-parallel-size 2` on the CPU: it answers; the reference's launch line
(seed.md: DSpark drafter, kimi_k3 parsers, fastsafetensors, max-model-len auto, no prefix
caching) starts at TP=2 and answers the reference's guidellm request shape; a rank killed with
SIGKILL fails the requests in flight and the server exits non-zero, in bounded time; two
"nodes" of one rank each on loopback (node 1 headless) serve together."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, REPO, RemoteServer, free_port

pytestmark = pytest.mark.timeout(600)


def _chat(url: str, **body) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 8, **body}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120.0,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()


def _rank_pids(root: int) -> list[int]:
    """Pids of `kdaserve.worker.rank` processes descending from process `root`."""
    parents, cmds = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmds[int(pid)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue

    def under(pid: int) -> bool:
        while pid > 1:
            if pid == root:
                return True
            pid = parents.get(pid, 0)
        return False
    return [p for p, c in cmds.items() if "kdaserve.worker.rank" in c and under(p)]


def test_served_chat_with_tp2(tiny_dir):
    srv = RemoteServer([tiny_dir, "--tensor-parallel-size", "2", "--api-key", API_KEY,
                        "--max-model-len", "512", "--served-model-name", "m"])
    try:
        assert len(_rank_pids(srv.proc.pid)) == 1
        out = _chat(srv.url, temperature=0.0)
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 8
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
    assert not _rank_pids(srv.proc.pid)


def test_reference_launch_line_with_dspark_at_tp2(tiny_dir, tmp_path):
    """seed.md's `vllm serve` flags with local paths (the tiny target, a make-model DSpark
    drafter for it) and TP=2, then guidellm's request: streamed chat, reasoning_effort max,
    temperature 1.0, top_p 0.95."""
    drafter = str(tmp_path / "dspark")
    subprocess.run([sys.executable, "-m", "kdaserve.entrypoints.cli", "make-model", drafter,
                    "--draft-for", tiny_dir, "--draft-method", "dspark"], check=True,
                   env=dict(os.environ, PYTHONPATH=REPO), capture_output=True)
    spec = {"model": drafter, "method": "dspark", "num_speculative_tokens": 8,
            "draft_sample_method": "probabilistic", "rejection_sample_method": "standard"}
    srv = RemoteServer([tiny_dir, "--tensor-parallel-size", "2", "--load-format",
                        "fastsafetensors", "--gpu-memory-utilization", "0.9",
                        "--reasoning-parser", "kimi_k3", "--enable-auto-tool-choice",
                        "--tool-call-parser", "kimi_k3", "--max-model-len", "auto",
                        "--no-enable-prefix-caching", "--speculative-config", json.dumps(spec),
                        "--api-key", API_KEY, "--served-model-name", "m"])
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "Tell me a story."}],
                "max_completion_tokens": 24, "stream": True,
                "stream_options": {"include_usage": True}, "reasoning_effort": "max",
                "temperature": 1.0, "top_p": 0.95}
        chunks = []
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=300.0,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        assert not any("error" in c for c in chunks), chunks
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert usage and 0 < usage[-1]["completion_tokens"] <= 24
        stats = httpx.get(srv.url + "/metrics", timeout=30.0,
                          headers={"Authorization": f"Bearer {API_KEY}"}).text
        drafts = [float(line.rsplit(" ", 1)[1]) for line in stats.splitlines()
                  if line.split("{")[0].endswith("spec_decode_num_drafts")
                  or line.split("{")[0].endswith("spec_decode_num_drafts_total")]
        assert drafts and max(drafts) > 0, "the DSpark drafter proposed nothing"
    finally:
        srv.stop()
    assert srv.proc.returncode == 0


def test_a_rank_killed_while_idle_ends_the_server(tiny_dir):
    """No step in flight, so no collective notices: the watchdog ends the engine."""
    srv = RemoteServer([tiny_dir, "--tensor-parallel-size", "2", "--max-model-len", "512"])
    try:
        (rank,) = _rank_pids(srv.proc.pid)
        os.kill(rank, signal.SIGKILL)
        assert srv.proc.wait(60) == 1
    finally:
        srv.stop()


def test_killed_rank_fails_requests_and_the_server_exits_nonzero(tiny_dir):
    srv = RemoteServer([tiny_dir, "--tensor-parallel-size", "2", "--api-key", API_KEY,
                        "--max-model-len", "4096", "--served-model-name", "m"])
    try:
        (rank,) = _rank_pids(srv.proc.pid)
        events: list[str] = []

        def stream() -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": "go"}],
                    "max_tokens": 3000, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body,
                                  timeout=120.0,
                                  headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line)
            except httpx.HTTPError as e:
                events.append(f"transport error: {e}")
        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 60
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(events) >= 3, "the stream never started"
        os.kill(rank, signal.SIGKILL)
        t0 = time.monotonic()
        code = srv.proc.wait(60)
        t.join(30)
        assert time.monotonic() - t0 < 60
        assert code != 0
        assert not t.is_alive()
        tail = [e for e in events if "error" in e]
        assert tail and "rank 1 died" in tail[0], events[-3:]
    finally:
        srv.stop()


def test_two_nodes_on_loopback(tiny_dir):
    """Node 1 (`--headless`) hosts rank 1; node 0's server hosts rank 0, the scheduler and
    the API. Greedy tokens equal the offline TP=1 engine's; the worker node exits 0 when node
    0 shuts down."""
    from kdaserve import LLM, SamplingParams

    port = free_port()
    node = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--max-model-len", "512"]
    worker = subprocess.Popen([sys.executable, "-m", "kdaserve.entrypoints.cli", "serve",
                               tiny_dir, *node, "--node-rank", "1", "--headless"],
                              env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="2"),
                              cwd=REPO)
    try:
        srv = RemoteServer([tiny_dir, *node, "--node-rank", "0", "--api-key", API_KEY,
                            "--served-model-name", "m"])
        try:
            assert not _rank_pids(srv.proc.pid)          # rank 1 lives on the other node
            prompt = [1, 5, 9, 33, 7, 12, 40]
            r = httpx.post(srv.url + "/v1/completions", timeout=120.0,
                           headers={"Authorization": f"Bearer {API_KEY}"},
                           json={"model": "m", "prompt": prompt, "max_tokens": 10,
                                 "temperature": 0.0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            served = r.json()["choices"][0]["text"]
        finally:
            srv.stop()
        assert srv.proc.returncode == 0
        assert worker.wait(30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    llm = LLM(tiny_dir, max_model_len=512, num_gpu_blocks=256)
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10 and served == out.text
