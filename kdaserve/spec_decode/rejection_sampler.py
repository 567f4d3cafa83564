"""Verification of draft tokens: standard rejection sampling (Leviathan et al. 2023), the greedy
exact-match path, and a labelled synthetic-acceptance mode for benchmarks with random weights.

Layout. A batch has B requests; request i brings K_i >= 0 draft tokens and 1 + K_i target rows:
the target distributions at its K_i draft positions, then at the bonus position. Target logits
are flattened in request order, [sum(1 + K_i), V]; a request with K_i = 0 is a plain sampling row,
so one call can serve a whole mixed batch.

Per request, for draft j = 0..K_i-1 in order:
    standard: accept x_j with probability min(1, p_j(x_j) / q_j(x_j));
              on the first rejection emit r ~ normalise(max(0, p_j - q_j)) and stop
    greedy row (temperature 0): accept while x_j == argmax p_j; on rejection emit argmax p_j
    synthetic: accept with a set per-position probability (see spec_decode.synthetic)
If every draft is accepted, emit a bonus token ~ p_{K_i}. The emitted tokens follow p exactly.
q = one-hot(x_j) when draft_probs is None (n-gram, greedy drafts): then accept with p_j(x_j) and
recover from p_j with x_j removed.

Device-side: no host syncs, no per-token Python loops. Seeded requests draw their random numbers
from their own generator (a loop over seeded requests only, as the Sampler does).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kdaserve.sample.metadata import SamplingMetadata, is_greedy_temperature
from kdaserve.sample.sampler import (
    SamplerOutput,
    filter_logits,
    gather_logprobs,
    to_logprob_dicts,
)

PLACEHOLDER_TOKEN_ID = -1
"""Fills output positions past a request's emitted tokens."""

REJECTION_SAMPLE_METHODS = ("standard", "synthetic")


@dataclass
class SpecDecodeMetadata:
    """Where each request's drafts and target rows sit in the flattened step."""

    draft_token_ids: torch.Tensor
    """[sum K_i] int64, device: drafts concatenated in request order."""
    num_draft_tokens: list[int]
    """[B] host: K_i."""
    max_spec_len: int
    row_req: torch.Tensor
    """[R] int64: request of each target row (R = sum(1 + K_i))."""
    row_pos: torch.Tensor
    """[R] int64: position of each target row within its request (K_i = the bonus row)."""
    draft_rows: torch.Tensor
    """[sum K_i] int64: target row of each draft."""
    cu_num_rows: torch.Tensor
    """[B + 1] int64: request i owns target rows cu_num_rows[i]:cu_num_rows[i+1]."""
    banned_token_ids: torch.Tensor | None = None
    """[2, N] int64 (target row, token) pairs masked to -inf (exact per-position min_tokens
    bans, see `spec_banned_ids`). None: SamplingMetadata.banned_token_ids, given per request,
    applies to every row of that request."""

    @property
    def num_reqs(self) -> int:
        return len(self.num_draft_tokens)

    @property
    def num_rows(self) -> int:
        return self.row_req.shape[0]

    @classmethod
    def make(cls, draft_token_ids: list[list[int]], device: torch.device | str = "cpu",
             banned: list[tuple[int, int]] | None = None) -> SpecDecodeMetadata:
        """draft_token_ids[i]: request i's drafts ([] for a request without drafts).
        banned: (target row, token) pairs, e.g. from `spec_banned_ids`."""
        if len(draft_token_ids) == 0:
            raise ValueError("SpecDecodeMetadata.make needs at least one request, got 0")
        num = [len(d) for d in draft_token_ids]
        flat = [t for d in draft_token_ids for t in d]
        if any(t < 0 for t in flat):
            raise ValueError(f"draft token ids must be >= 0, got {min(flat)}")
        counts = np.asarray(num, dtype=np.int64) + 1
        cu = np.zeros(len(num) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        row_req = np.repeat(np.arange(len(num), dtype=np.int64), counts)
        row_pos = np.arange(cu[-1], dtype=np.int64) - cu[row_req]
        draft_rows = np.nonzero(row_pos < np.asarray(num, dtype=np.int64)[row_req])[0]
        banned_t = None
        if banned:
            for row, tok in banned:
                if not 0 <= row < int(cu[-1]) or tok < 0:
                    raise ValueError(f"banned (row, token) pair {(row, tok)} out of range for "
                                     f"{int(cu[-1])} target rows")
            banned_t = torch.tensor(banned, dtype=torch.int64).T.contiguous().to(
                device, non_blocking=True)

        def dev(a):
            return torch.from_numpy(a).to(device, non_blocking=True)
        flat_t = torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True)
        return cls(draft_token_ids=flat_t,
                   num_draft_tokens=num, max_spec_len=max(num), row_req=dev(row_req),
                   row_pos=dev(row_pos), draft_rows=dev(draft_rows), cu_num_rows=dev(cu),
                   banned_token_ids=banned_t)


@dataclass
class RejectionSamplerOutput:
    output_token_ids: torch.Tensor
    """[B, max_spec_len + 1] int64: accepted drafts, then the recovered or bonus token, then
    PLACEHOLDER_TOKEN_ID."""
    num_accepted: torch.Tensor
    """[B] int64: drafts accepted per request (the request emits num_accepted + 1 tokens)."""
    accepted_per_position: torch.Tensor
    """[max_spec_len] int64: requests whose draft at position j was accepted."""
    row_logprobs: SamplerOutput | None = None
    """Per target row: logprobs of the token that row emits (the accepted draft, or the
    recovered / bonus token); rows past a request's first rejection are meaningless."""

    def parse_output(self) -> list[list[int]]:
        """Host lists of each request's emitted tokens (one device->host copy)."""
        rows = self.output_token_ids.tolist()
        return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in rows]


class RejectionSampler(nn.Module):
    """target logits + drafts (+ draft probabilities) -> the tokens each request emits.

    method: "standard" (lossless) or "synthetic" (accept with set rates; NOT lossless: for
    benchmarks with random weights only). synthetic_rates: per-position *unconditional*
    acceptance rates (entry j = probability that the first j + 1 drafts are all accepted),
    as resolved by `spec_decode.synthetic.resolve_synthetic_rates`.
    """

    def __init__(self, method: str = "standard",
                 synthetic_rates: list[float] | None = None,
                 threshold_kernel: bool = False, race_kernel: bool = False) -> None:
        super().__init__()
        self.threshold_kernel = threshold_kernel
        """Top-k / top-p through the sort-free threshold kernel on CUDA (see Sampler)."""
        self.race_kernel = race_kernel
        """CUDA: under synthetic acceptance each row's candidate is drawn by the fused
        exponential race on its filtered logits (kernels/sample/race.py; p is not needed
        there); under standard acceptance p comes from the row-split softmax
        (kernels/sample/softmax.py)."""
        if method not in REJECTION_SAMPLE_METHODS:
            raise ValueError(f"rejection_sample_method must be one of "
                             f"{REJECTION_SAMPLE_METHODS}, got {method!r}")
        if method == "synthetic":
            if not synthetic_rates:
                raise ValueError("synthetic rejection sampling needs synthetic_rates")
            if any(not 0.0 <= r <= 1.0 for r in synthetic_rates) or any(
                    b > a for a, b in itertools.pairwise(synthetic_rates)):
                raise ValueError(f"synthetic_rates must be non-increasing values in [0, 1], "
                                 f"got {synthetic_rates}")
        self.method = method
        self.synthetic_rates = list(synthetic_rates or [])
        self._rates: torch.Tensor | None = None

    def _rates_on(self, device: torch.device) -> torch.Tensor:
        """The synthetic rates on `device`, copied once (a per-step pageable copy would make
        the host wait there for the whole forward)."""
        if self._rates is None or self._rates.device != device:
            self._rates = torch.tensor(self.synthetic_rates, dtype=torch.float32, device=device)
        return self._rates

    @property
    def is_synthetic(self) -> bool:
        return self.method == "synthetic"

    def forward(self, target_logits: torch.Tensor, spec: SpecDecodeMetadata,
                md: SamplingMetadata, draft_probs: torch.Tensor | None = None
                ) -> RejectionSamplerOutput:
        """target_logits: [R, V]; md: one row per request; draft_probs: [sum K_i, V] (the
        distribution each draft was sampled from, after the draft's temperature) or None."""
        R, V = self._check(target_logits, spec, md, draft_probs)
        B, Kmax = spec.num_reqs, spec.max_spec_len
        device = target_logits.device
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(target_logits.float(), dim=-1)   # [R, V]
        logits = self._apply_bans(target_logits.float(), spec, md)            # [R, V]
        if md.processing is not None:   # penalties / logit_bias (rows index the R logits)
            logits = md.processing.apply(logits)

        greedy_row = is_greedy_temperature(md.temperature)[spec.row_req]      # [R]
        argmax = None if md.all_random else logits.argmax(dim=-1)             # [R]
        race = (self.race_kernel and self.is_synthetic and logits.is_cuda
                and not md.all_greedy)
        probs = None if md.all_greedy or race else self._target_probs(
            logits, spec, md, self.threshold_kernel, self.race_kernel)          # [R, V]
        uniform, noise = self._draw(spec, md, R, V, device, need_noise=probs is not None)

        drafts = spec.draft_token_ids                                          # [D]
        d_rows = spec.draft_rows
        d_req = spec.row_req[d_rows]
        accepted = self._accept(drafts, d_rows, d_req, spec, greedy_row, argmax, probs,
                                draft_probs, uniform)                          # [D] bool
        if race:
            candidate = self._race_candidates(logits, spec, md, greedy_row, argmax)  # [R]
        else:
            candidate = self._candidates(drafts, d_rows, greedy_row, argmax, probs,
                                         draft_probs, noise)                   # [R]

        # Accepted prefix per request: [B, Kmax] padded with False, cumulative AND.
        acc = torch.zeros(B, max(Kmax, 1), dtype=torch.bool, device=device)
        acc[d_req, spec.row_pos[d_rows]] = accepted
        prefix = acc.to(torch.int64).cumprod(dim=1)[:, :Kmax]                 # [B, Kmax]
        num_accepted = prefix.sum(dim=1)                                       # [B]

        out = torch.full((B, Kmax + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
        draft_pad = torch.zeros(B, max(Kmax, 1), dtype=torch.int64, device=device)
        draft_pad[d_req, spec.row_pos[d_rows]] = drafts
        out[:, :Kmax] = torch.where(prefix.bool(), draft_pad[:, :Kmax], out[:, :Kmax])
        last_row = spec.cu_num_rows[:-1] + num_accepted                        # [B]
        out.scatter_(1, num_accepted.unsqueeze(1), candidate[last_row].unsqueeze(1))

        row_lp = None
        if raw_logprobs is not None:
            row_token = candidate.clone()
            row_token[d_rows] = torch.where(accepted, drafts, candidate[d_rows])
            row_lp = SamplerOutput(row_token, *gather_logprobs(raw_logprobs,
                                                               md.max_num_logprobs, row_token))
        return RejectionSamplerOutput(out, num_accepted, prefix.sum(dim=0), row_lp)

    # -----------------------------------------------------------------------------------------

    def _check(self, logits, spec: SpecDecodeMetadata, md: SamplingMetadata, draft_probs):
        if logits.dim() != 2 or logits.shape[0] != spec.num_rows:
            raise ValueError(f"target_logits must be [sum(1 + K_i)={spec.num_rows}, vocab], "
                             f"got {tuple(logits.shape)}")
        if md.num_rows != spec.num_reqs:
            raise ValueError(f"SamplingMetadata has {md.num_rows} rows, expected one per "
                             f"request ({spec.num_reqs})")
        D = spec.draft_token_ids.shape[0]
        if draft_probs is not None and draft_probs.shape != (D, logits.shape[1]):
            raise ValueError(f"draft_probs must be [{D}, {logits.shape[1]}], "
                             f"got {tuple(draft_probs.shape)}")
        if self.is_synthetic and spec.max_spec_len > len(self.synthetic_rates):
            raise ValueError(f"a request has {spec.max_spec_len} drafts but only "
                             f"{len(self.synthetic_rates)} synthetic rates are set")
        return logits.shape

    @staticmethod
    def _apply_bans(logits, spec: SpecDecodeMetadata, md: SamplingMetadata):
        if spec.banned_token_ids is not None:
            rows, toks = spec.banned_token_ids
        elif md.banned_token_ids is not None:
            # Request-level bans apply at every position of the request.
            req, toks = md.banned_token_ids                                   # [N], [N]
            per_req = spec.cu_num_rows[1:] - spec.cu_num_rows[:-1]            # [B]
            counts = per_req[req]
            rows = (torch.repeat_interleave(spec.cu_num_rows[:-1][req], counts)
                    + _ragged_arange(counts))
            toks = torch.repeat_interleave(toks, counts)
        else:
            return logits
        return logits.index_put((rows, toks), logits.new_full((), float("-inf")))

    @staticmethod
    def _target_logits(logits, spec: SpecDecodeMetadata, md: SamplingMetadata,
                       threshold_kernel: bool = False, want_tau: bool = False):
        """(filtered logits, tau or None) per target row: temperature, top-k, top-p, min-p of
        the row's request (sampler.filter_logits)."""
        temp = md.temperature
        if not md.all_random:
            temp = torch.where(is_greedy_temperature(temp), 1.0, temp)
        r = spec.row_req
        return filter_logits(logits / temp[r].unsqueeze(1),
                             None if md.no_top_k else md.top_k[r],
                             None if md.no_top_p else md.top_p[r],
                             None if md.no_min_p else md.min_p[r], md.max_top_k, md.all_top_k,
                             threshold_kernel, want_tau)

    @classmethod
    def _target_probs(cls, logits, spec: SpecDecodeMetadata, md: SamplingMetadata,
                      threshold_kernel: bool = False, split_softmax: bool = False):
        """p per target row: temperature, top-k, top-p, min-p of the row's request.
        split_softmax (CUDA): kernels/sample/softmax.py's row-split softmax."""
        filtered = cls._target_logits(logits, spec, md, threshold_kernel)[0]
        if split_softmax and filtered.is_cuda:
            from kdaserve.kernels.sample.softmax import tempered_softmax

            return tempered_softmax(filtered.float().contiguous())
        return torch.softmax(filtered, dim=-1)

    def _race_candidates(self, logits, spec: SpecDecodeMetadata, md: SamplingMetadata,
                         greedy_row, argmax):
        """Synthetic acceptance: every row's candidate is a draw from p (no residual), by the
        race on the filtered logits; a seeded request's rows take their keys from its
        generator, after its uniforms (as _draw orders its noise)."""
        from kdaserve.kernels.sample.race import race_sample

        filtered, tau = self._target_logits(logits, spec, md, self.threshold_kernel,
                                            want_tau=True)
        R = logits.shape[0]
        seeds = torch.empty(R, dtype=torch.int64, device=logits.device)
        if len(md.generators) < spec.num_reqs:
            seeds.random_(0, 2**62)
        if md.generators:
            cu = np.cumsum([0] + [k + 1 for k in spec.num_draft_tokens]).tolist()   # host
            for req, gen in md.generators.items():
                seeds[cu[req]:cu[req + 1]].random_(0, 2**62, generator=gen)
        sampled = race_sample(filtered, seeds, tau)
        return sampled if argmax is None else torch.where(greedy_row, argmax, sampled)

    def _draw(self, spec: SpecDecodeMetadata, md: SamplingMetadata, R: int, V: int, device,
              need_noise: bool):
        """uniform: [D] in (0, 1] per draft (synthetic: one per request, expanded);
        noise: [R, V] Exp(1) per target row. A seeded request draws its uniforms, then its
        noise rows, from its own generator."""
        D = spec.draft_token_ids.shape[0]
        n_u = spec.num_reqs if self.is_synthetic else D
        uniform = torch.rand(n_u, device=device)
        noise = torch.empty(R, V, device=device) if need_noise else None
        if noise is not None and len(md.generators) < spec.num_reqs:
            noise.exponential_()
        if md.generators:
            cu_d = np.cumsum([0] + spec.num_draft_tokens).tolist()
            cu_rows = [c + i for i, c in enumerate(cu_d)]
            for req, gen in md.generators.items():
                s, e = (req, req + 1) if self.is_synthetic else (cu_d[req], cu_d[req + 1])
                if e > s:
                    uniform[s:e] = torch.rand(e - s, device=device, generator=gen)
                if noise is not None:
                    noise[cu_rows[req]:cu_rows[req + 1]].exponential_(generator=gen)
        uniform = 1.0 - uniform                                                # (0, 1]
        if self.is_synthetic:
            uniform = uniform[spec.row_req[spec.draft_rows]]
        if noise is not None:
            noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return uniform, noise

    def _accept(self, drafts, d_rows, d_req, spec, greedy_row, argmax, probs, draft_probs,
                uniform) -> torch.Tensor:
        if self.is_synthetic:
            rates = self._rates_on(drafts.device)
            # u <= a_j holds for a prefix of positions because the rates do not increase.
            return uniform <= rates[spec.row_pos[d_rows]]
        greedy_ok = None
        if argmax is not None:
            greedy_ok = drafts == argmax[d_rows]
            if probs is None:
                return greedy_ok
        p_x = probs[d_rows].gather(1, drafts.unsqueeze(1)).squeeze(1)           # [D]
        if draft_probs is None:
            random_ok = p_x >= uniform                                         # q(x) = 1
        else:
            q_x = draft_probs.float().gather(1, drafts.unsqueeze(1)).squeeze(1)
            random_ok = (q_x > 0) & (p_x >= uniform * q_x)
        if greedy_ok is None:
            return random_ok
        return torch.where(greedy_row[d_rows], greedy_ok, random_ok)

    def _candidates(self, drafts, d_rows, greedy_row, argmax, probs, draft_probs, noise):
        """The token each target row emits if the request stops there: the recovered token on
        a draft row, the bonus token on the last row. Each row has its own noise."""
        if probs is None:
            return argmax
        dist = probs
        if not self.is_synthetic:
            residual = probs[d_rows]
            if draft_probs is None:
                residual = residual.scatter(1, drafts.unsqueeze(1), 0.0)
            else:
                residual = (residual - draft_probs.float()).clamp_(min=0.0)
            # All-zero residual: p == q, so rejection had probability 0; fall back to p.
            empty = residual.sum(dim=1, keepdim=True) <= 0
            residual = torch.where(empty, probs[d_rows], residual)
            dist = probs.index_copy(0, d_rows, residual)
        sampled = dist.div(noise).argmax(dim=-1)                               # [R]
        if argmax is None:
            return sampled
        return torch.where(greedy_row, argmax, sampled)


def _ragged_arange(counts: torch.Tensor) -> torch.Tensor:
    """[sum counts]: 0..c-1 for each c in counts."""
    total_before = torch.cumsum(counts, 0) - counts
    idx = torch.arange(int(counts.sum()), device=counts.device)
    return idx - torch.repeat_interleave(total_before, counts)


def spec_banned_ids(min_tokens: list[int], num_output_tokens: list[int],
                    stop_ids: list[set[int]], num_draft_tokens: list[int]
                    ) -> list[tuple[int, int]]:
    """Exact min_tokens bans for a spec step: (target row, token) pairs.

    Row j of request i would emit output number num_output_tokens[i] + j, so stop_ids[i] (EOS
    unless ignore_eos, plus stop_token_ids: see `min_tokens_banned_ids`) is banned there while
    that number is below min_tokens[i]."""
    pairs: list[tuple[int, int]] = []
    row = 0
    for mt, n_out, stops, k in zip(min_tokens, num_output_tokens, stop_ids, num_draft_tokens):
        for j in range(k + 1):
            if n_out + j < mt:
                pairs.extend((row + j, tok) for tok in sorted(stops))
        row += k + 1
    return pairs


def spec_logprob_dicts(out: RejectionSamplerOutput, spec: SpecDecodeMetadata,
                       num_logprobs: list[int | None]):
    """Per request, per emitted token: ({token_id: logprob}, {token_id: rank}), or None for
    requests without logprobs. One host copy per tensor."""
    if out.row_logprobs is None:
        return [None] * spec.num_reqs
    row_n = [num_logprobs[r] for r in spec.row_req.tolist()]
    lp_dicts, rank_dicts = to_logprob_dicts(out.row_logprobs, row_n)
    cu = spec.cu_num_rows.tolist()
    n_acc = out.num_accepted.tolist()
    result = []
    for i, n in enumerate(num_logprobs):
        if n is None:
            result.append(None)
            continue
        rows = range(cu[i], cu[i] + n_acc[i] + 1)
        result.append([(lp_dicts[r], rank_dicts[r]) for r in rows])
    return result
