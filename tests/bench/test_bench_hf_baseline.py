# SPDX-License-Identifier: Apache-2.0
"""benchmarks/hf_baseline.py on the CPU with the tiny preset's config (the CI-sized path)."""

import importlib.util
import json
import os

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "hf_baseline.py")


@pytest.fixture(scope="module")
def hf_baseline():
    spec = importlib.util.spec_from_file_location("hf_baseline", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    from kdaserve.models.make_model import make_model

    return os.path.join(make_model(str(tmp_path_factory.mktemp("hf") / "tiny"), "tiny"),
                        "config.json")


def test_random_weights_are_normal_002(hf_baseline, tiny_config):
    model = hf_baseline.build_model(tiny_config, torch.device("cpu"), torch.float32, 0, "sdpa")
    mats = {n: p for n, p in model.named_parameters()
            if p.ndim >= 2 and not n.endswith(hf_baseline.KEEP_INIT)}
    assert any("experts" in n for n in mats) and any("gate.weight" in n for n in mats)
    flat = torch.cat([p.detach().flatten() for p in mats.values()])
    assert flat.mean().abs() < 1e-3 and abs(flat.std().item() - 0.02) < 1e-3
    again = hf_baseline.build_model(tiny_config, torch.device("cpu"), torch.float32, 0, "sdpa")
    assert all(torch.equal(p, dict(again.named_parameters())[n]) for n, p in mats.items())


def test_decode_with_cache_matches_full_recompute(hf_baseline, tiny_config):
    model = hf_baseline.build_model(tiny_config, torch.device("cpu"), torch.float32, 0, "sdpa")
    r = hf_baseline.run_batch(model, 1, 24, 6, torch.device("cpu"), seed=3)
    gen = torch.Generator().manual_seed(3 + 1)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=gen)
    with torch.inference_mode():
        for _ in range(7):
            nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    assert r["first_tokens"] == ids[0, 24:].tolist()[:8]


def test_cli_writes_json(hf_baseline, tiny_config, tmp_path):
    out = tmp_path / "hf.json"
    rc = hf_baseline.main([tiny_config, "--device", "cpu", "--dtype", "float32", "--input-len",
                           "32", "--decode-steps", "3", "--batch-sizes", "1,2", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [b["batch_size"] for b in res["batches"]] == [1, 2]
    for b in res["batches"]:
        assert b["ttft_ms"] > 0 and b["decode_ms_per_step"] > 0
        assert b["output_tok_s"] == pytest.approx(b["batch_size"] * 1000 / b["decode_ms_per_step"])
    k = res["kernels"]
    assert set(k) >= {"fla_installed", "chunk_kimi_delta_attention",
                      "recurrent_kimi_delta_attention"}
    if not k["fla_installed"]:
        assert k["chunk_kimi_delta_attention"] == "torch (transformers reference)"
    assert res["gpu"] and res["weights"].startswith("random N(0, 0.02)")
    with pytest.raises(SystemExit):
        hf_baseline.main([tiny_config, "--batch-sizes", "0"])
