"""A small greedy engine loop over the real tiny model that wires the speculative-decoding pieces
the way the model runner should: proposer -> batch (spec rows + non-spec rows) -> KDA verify
(RecoverSSM or per-position) -> RejectionSampler -> commit / select -> bookkeeping.

The KDA backend entry points (kda_backend.short_conv / delta_rule) are swapped for spec-aware
versions that split the batch into its spec and non-spec groups, either as contiguous views
(spec rows first) or with index_select / index_copy_ (rows interleaved), send the spec group
through kernels.kda.recover and the non-spec group through the original backend.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from kdaserve.attention import kda_backend
from kdaserve.attention.builder import build_metadata
from kdaserve.attention.forward_context import ForwardContext
from kdaserve.config import LoadConfig
from kdaserve.kernels.kda import recover as rc
from kdaserve.config.model_args import KimiLinearArgs
from kdaserve.models.loader import load_weights
from kdaserve.models.registry import build_model, resolve_architecture
from kdaserve.sample.metadata import SamplingMetadata
from kdaserve.spec_decode.rejection_sampler import RejectionSampler, SpecDecodeMetadata
from kdaserve.sampling_params import SamplingParams
from kdaserve.spec_decode.metrics import SpecDecodingStats
from kdaserve.spec_decode.ngram import NgramProposer
from kdaserve.attention.caches import allocate_caches

BS = 16


def load_model(path: str):
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    args = KimiLinearArgs.from_hf_config(hf)
    model = build_model(args, torch.float32, "cpu", resolve_architecture(hf))
    load_weights(model, path, LoadConfig())
    return model, args


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    slots: list[int]
    """Column 0: own slot; 1..K: per-position scratch slots."""
    blocks: list[int]
    out: list[int] = field(default_factory=list)
    num_computed: int = 0
    drafts: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_tokens


@dataclass
class _StepGroups:
    """Token layout of the spec group inside the flat batch."""

    tok_spec: torch.Tensor       # [T_spec] token indices of spec rows in the flat batch
    tok_non: torch.Tensor        # [T_non]
    span_spec: tuple[int, int] | None   # contiguous [s, e) when the spec rows are contiguous
    cu_spec: torch.Tensor        # [N_spec + 1]
    idx_spec: torch.Tensor       # [N_spec] or [N_spec, 1+K]
    md_non: object               # AttentionMetadata of the non-spec rows (or None)
    conv_x: dict = field(default_factory=dict)
    records: dict = field(default_factory=dict)


class SpecHarness:
    def __init__(self, model, args, num_spec: int, state_mode: str = "recover",
                 contiguous: bool = True, proposer=None, max_reqs: int = 8) -> None:
        if state_mode not in ("recover", "per_position"):
            raise ValueError(state_mode)
        self.model, self.args = model, args
        self.k = num_spec
        self.mode, self.contiguous, self.proposer = state_mode, contiguous, proposer
        slots_per_req = 1 + (num_spec if state_mode == "per_position" else 0)
        self.caches = allocate_caches(args, max_reqs * 8, BS, max_reqs * slots_per_req,
                                      torch.float32, "cpu")
        self.free_slots = list(range(max_reqs * slots_per_req))
        self.free_blocks = list(range(max_reqs * 8))
        self.slots_per_req = slots_per_req
        self.reqs: list[Req] = []
        self.sampler = RejectionSampler()
        self.stats = SpecDecodingStats(max(num_spec, 1))
        self.groups: _StepGroups | None = None

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        slots = [self.free_slots.pop(0) for _ in range(self.slots_per_req)]
        blocks = [self.free_blocks.pop(0) for _ in range(8)]
        self.reqs.append(Req(rid, list(prompt), max_tokens, slots, blocks))

    # -----------------------------------------------------------------------------------------

    def step(self) -> None:
        live = [r for r in self.reqs if not r.done]
        is_spec = [len(r.drafts) > 0 for r in live]
        if self.contiguous:    # spec rows first: each group is one slice
            order = sorted(range(len(live)), key=lambda i: not is_spec[i])
        else:                  # interleave spec and non-spec rows
            spec_i = [i for i in range(len(live)) if is_spec[i]]
            non_i = [i for i in range(len(live)) if not is_spec[i]]
            order = [x for pair in zip(non_i, spec_i) for x in pair]
            order += spec_i[len(non_i):] + non_i[len(spec_i):]
        batch = [live[i] for i in order]
        spec_flags = [len(r.drafts) > 0 for r in batch]
        queries = []
        for r in batch:
            if r.num_computed < len(r.prompt):
                queries.append(r.prompt[r.num_computed:])
            else:
                queries.append([r.tokens[-1]] + r.drafts)
        self._prepare_groups(batch, queries, spec_flags)
        md = build_metadata([len(q) for q in queries], [r.num_computed for r in batch],
                            [r.blocks for r in batch], [r.slots[0] for r in batch], BS, "cpu",
                            num_decodes=0)
        ids = torch.tensor([t for q in queries for t in q])
        with torch.inference_mode(), _patched_backend(self):
            hidden = self.model(ids, ForwardContext(md, self.caches))
        # logits rows: all positions of spec rows, the last of the others
        qsl = md.query_start_loc_cpu.tolist()
        rows, sample_reqs, drafts = [], [], []
        for i, r in enumerate(batch):
            if spec_flags[i]:
                rows.extend(range(qsl[i], qsl[i + 1]))
            else:
                rows.append(qsl[i + 1] - 1)
            sample_reqs.append(i)
            drafts.append(r.drafts if spec_flags[i] else [])
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[torch.tensor(rows)])
        spec_md = SpecDecodeMetadata.make(drafts)
        smd = SamplingMetadata.build([SamplingParams(temperature=0.0)] * len(batch))
        res = self.sampler(logits, spec_md, smd)
        emitted = res.parse_output()
        n_spec = [len(emitted[i]) for i in range(len(batch)) if spec_flags[i]]
        if any(spec_flags):
            self._commit(torch.tensor(n_spec))
        self.stats.observe_batch([len(d) for d in drafts], res.num_accepted.tolist())
        for i, r in enumerate(batch):
            if r.num_computed < len(r.prompt):
                r.num_computed = len(r.prompt)
                r.out.append(emitted[i][0])
            else:
                r.num_computed += len(emitted[i])       # last token + accepted drafts
                r.out.extend(emitted[i])
            r.out = r.out[:r.max_tokens]
            r.drafts = []
        self._propose([r for r in batch if not r.done])

    def _propose(self, reqs: list[Req]) -> None:
        if self.proposer is None or not reqs:
            return
        caps = [min(self.k, r.max_tokens - len(r.out) - 1) for r in reqs]
        if isinstance(self.proposer, NgramProposer):
            drafts = self.proposer.propose([r.tokens for r in reqs], caps)
        else:
            drafts = self.proposer.propose([r.rid for r in reqs], [r.tokens for r in reqs],
                                           max_drafts=caps).draft_token_ids
        for r, d in zip(reqs, drafts):
            r.drafts = list(d)

    def run(self) -> dict[str, list[int]]:
        while any(not r.done for r in self.reqs):
            self.step()
        return {r.rid: r.out for r in self.reqs}

    # -----------------------------------------------------------------------------------------

    def _prepare_groups(self, batch, queries, spec_flags) -> None:
        lens = [len(q) for q in queries]
        starts = [sum(lens[:i]) for i in range(len(lens))]
        tok_spec = [t for i in range(len(batch)) if spec_flags[i]
                    for t in range(starts[i], starts[i] + lens[i])]
        tok_non = [t for i in range(len(batch)) if not spec_flags[i]
                   for t in range(starts[i], starts[i] + lens[i])]
        spec_rows = [i for i in range(len(batch)) if spec_flags[i]]
        non_rows = [i for i in range(len(batch)) if not spec_flags[i]]
        if not spec_rows:
            self.groups = None
            return
        span = None
        if tok_spec == list(range(tok_spec[0], tok_spec[0] + len(tok_spec))):
            span = (tok_spec[0], tok_spec[0] + len(tok_spec))
        cu = torch.tensor([0] + torch.tensor([lens[i] for i in spec_rows]).cumsum(0).tolist(),
                          dtype=torch.int32)
        if self.mode == "per_position":
            idx = torch.tensor([batch[i].slots for i in spec_rows], dtype=torch.int32)
        else:
            idx = torch.tensor([batch[i].slots[0] for i in spec_rows], dtype=torch.int32)
        md_non = None
        if non_rows:
            md_non = build_metadata([lens[i] for i in non_rows],
                                    [batch[i].num_computed for i in non_rows],
                                    [batch[i].blocks for i in non_rows],
                                    [batch[i].slots[0] for i in non_rows], BS, "cpu",
                                    num_decodes=0)
        self.groups = _StepGroups(torch.tensor(tok_spec), torch.tensor(tok_non, dtype=torch.long),
                                  span if self.contiguous else None, cu, idx, md_non)

    def _split(self, x: torch.Tensor):
        g = self.groups
        if g.span_spec is not None:
            s, e = g.span_spec
            return x[s:e], (torch.cat([x[:s], x[e:]]) if g.md_non is not None else None)
        return (x.index_select(0, g.tok_spec),
                x.index_select(0, g.tok_non) if g.md_non is not None else None)

    def _merge(self, out: torch.Tensor, spec_part, non_part) -> torch.Tensor:
        g = self.groups
        if g.span_spec is not None:
            s, e = g.span_spec
            out[s:e] = spec_part
            if non_part is not None:
                n_before = s
                out[:s] = non_part[:n_before]
                out[e:] = non_part[n_before:]
            return out
        out.index_copy_(0, g.tok_spec, spec_part)
        if non_part is not None:
            out.index_copy_(0, g.tok_non, non_part)
        return out

    def short_conv(self, orig, x, weight, md, conv_cache, *head_shape):
        """head_shape: (num_heads, head_dim) when the backend returns q, k, v views."""
        g = self.groups
        if g is None:
            return orig(x, weight, md, conv_cache, *head_shape)
        xs, xn = self._split(x)
        pp = self.mode == "per_position"
        ys = rc.conv_spec_verify(xs, weight, g.cu_spec, conv_cache, g.idx_spec, per_position=pp)
        g.conv_x[id(conv_cache)] = xs
        yn = None
        if xn is not None:
            yn = orig(xn, weight, g.md_non, conv_cache, *head_shape)
            if head_shape:
                yn = torch.cat([t.reshape(xn.shape[0], -1) for t in yn], dim=-1)
        y = self._merge(torch.empty_like(x), ys, yn)
        if head_shape:
            return y.view(x.shape[0], 3, *head_shape).unbind(1)
        return y

    def delta_rule(self, orig, q, k, v, g_raw, beta_logits, gate, md, rec_cache):
        g = self.groups
        if g is None:
            return orig(q, k, v, g_raw, beta_logits, gate, md, rec_cache)
        parts = [self._split(t) for t in (q, k, v, g_raw, beta_logits)]
        spec_in = [p[0] for p in parts]
        pp = self.mode == "per_position"
        os_, records = rc.kda_spec_verify(
            *spec_in, g.cu_spec, rec_cache, g.idx_spec, per_position=pp,
            gate=rc.KDAGateParams(gate.A_log, gate.dt_bias, gate.lower_bound))
        g.records[id(rec_cache)] = records
        on = None
        if g.md_non is not None:
            on = orig(*[p[1] for p in parts], gate, g.md_non, rec_cache)
        return self._merge(torch.empty_like(v), os_, on)

    def _commit(self, num_accepted: torch.Tensor) -> None:
        g = self.groups
        if self.mode == "per_position":
            rc.select_per_position([*self.caches.kda_recurrent, *self.caches.kda_conv],
                                   g.idx_spec, num_accepted)
            return
        for rec, conv in zip(self.caches.kda_recurrent, self.caches.kda_conv):
            rc.kda_recover_commit(rec, g.idx_spec, g.records[id(rec)], g.cu_spec, num_accepted)
            rc.conv_recover_commit(conv, g.idx_spec, g.conv_x[id(conv)], g.cu_spec,
                                   num_accepted)


class _patched_backend:
    """Route the KDA layers' backend calls through the harness for one forward."""

    def __init__(self, harness: SpecHarness) -> None:
        self.h = harness

    def __enter__(self):
        self.orig = (kda_backend.short_conv, kda_backend.delta_rule)
        oc, od = self.orig
        # pdl only changes how CUDA kernels launch: the harness's CPU path ignores it
        kda_backend.short_conv = lambda *a, pdl=False: self.h.short_conv(oc, *a)
        kda_backend.delta_rule = lambda *a: self.h.delta_rule(od, *a)

    def __exit__(self, *exc):
        kda_backend.short_conv, kda_backend.delta_rule = self.orig
