"""kdaserve's CPU reference path vs transformers' KimiLinearForCausalLM, fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kdaserve.attention.builder import build_metadata
from kdaserve.attention.forward_context import ForwardContext, StepPlan
from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.models.registry import build_model
from kdaserve.attention.caches import allocate_caches
from tests.models.hf_tiny import make_hf_model

BLOCK = 16


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def pair():
    hf = make_hf_model(seed=0)
    cfg = hf.config.to_dict()
    cfg["linear_attn_config"] = {"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                                 "kda_layers": [1, 2, 4, 5], "full_attn_layers": [3]}
    args = KimiLinearArgs.from_hf_config(cfg)
    ours = build_model(args, torch.float32, "cpu")
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=True)
    assert not missing and not unexpected
    ours.process_weights_after_loading()
    return hf, ours, args


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


class Runner:
    """Drives the model with explicit per-request block lists and state slots."""

    def __init__(self, model, args, num_reqs, dtype=torch.float32, device="cpu", pdl=False):
        """pdl: the eager steps launch their kernels with PDL (as captured graphs do)."""
        self.model, self.args, self.device, self.pdl = model, args, device, pdl
        self.caches = allocate_caches(args, num_blocks=64, block_size=BLOCK, num_slots=num_reqs + 2,
                                      dtype=dtype, device=device)
        self.blocks = [list(range(i * 16, (i + 1) * 16)) for i in range(num_reqs)]
        self.slots = [i + 1 for i in range(num_reqs)]

    def step(self, reqs):
        """reqs: list of (req_index, token_ids, num_computed). Returns logits per request rows."""
        reqs = sorted(reqs, key=lambda r: not (len(r[1]) == 1 and r[2] > 0))
        md = build_metadata([len(r[1]) for r in reqs], [r[2] for r in reqs],
                            [self.blocks[r[0]] for r in reqs], [self.slots[r[0]] for r in reqs],
                            BLOCK, self.device)
        ids = torch.tensor([t for r in reqs for t in r[1]], device=self.device)
        plan = dataclasses.replace(StepPlan.eager(md), pdl=self.pdl)
        with torch.no_grad():
            h = self.model(ids, ForwardContext(md, self.caches, plan))
            logits = self.model.compute_logits(h)
        out, qsl = {}, md.query_start_loc_cpu.tolist()
        for i, r in enumerate(reqs):
            out[r[0]] = logits[qsl[i]:qsl[i + 1]].cpu()
        return out


PROMPTS = [[5, 9, 17, 3, 8], list(range(3, 73)), [(7 * i + 3) % 120 + 4 for i in range(133)]]


def test_one_flattened_batch_matches_hf(pair):
    hf, ours, args = pair
    runner = Runner(ours, args, len(PROMPTS))
    out = runner.step([(i, p, 0) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        assert rel(out[i], hf_logits(hf, p)) <= 1e-4


def run_chunked(runner, extra):
    """Prefill PROMPTS in odd-sized chunks, then one-token decode steps; logits per prompt."""
    chunk_sizes = [3, 17, 29, 1, 64, 7]
    pos = [0] * len(PROMPTS)
    got = {i: [] for i in range(len(PROMPTS))}
    step = 0
    while any(pos[i] < len(p) for i, p in enumerate(PROMPTS)):
        reqs = []
        for i, p in enumerate(PROMPTS):
            if pos[i] < len(p):
                n = min(chunk_sizes[(step + i) % len(chunk_sizes)], len(p) - pos[i])
                reqs.append((i, p[pos[i]:pos[i] + n], pos[i]))
        for i, logits in runner.step(reqs).items():
            got[i].append(logits)
        for i, toks, c in reqs:
            pos[i] += len(toks)
        step += 1
    for t in extra:   # one-token decode steps for every request at once
        reqs = [(i, [t], pos[i]) for i in range(len(PROMPTS))]
        for i, logits in runner.step(reqs).items():
            got[i].append(logits)
            pos[i] += 1
    return {i: torch.cat(v) for i, v in got.items()}


EXTRA = [11, 40, 77, 5]


def test_chunked_prefill_then_decode_matches_hf(pair):
    hf, ours, args = pair
    got = run_chunked(Runner(ours, args, len(PROMPTS)), EXTRA)
    for i, p in enumerate(PROMPTS):
        assert rel(got[i], hf_logits(hf, p + EXTRA)) <= 1e-4
