"""Token sampler: greedy, temperature, top-k, top-p, min-p, per-row seeds, raw logprobs.

Device-only hot path: no .item() and no host branching on tensor values; host flags in
SamplingMetadata decide which filters run at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kdaserve.sample.metadata import SamplingMetadata, is_greedy_temperature


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    """[B] int64."""
    logprob_token_ids: torch.Tensor | None = None
    """[B, k + 1] int64: column 0 = the sampled token, then the top-k tokens by logprob."""
    logprobs: torch.Tensor | None = None
    """[B, k + 1] fp32, raw model log-probabilities of logprob_token_ids."""
    ranks: torch.Tensor | None = None
    """[B] int64: 1-based rank of the sampled token in the raw distribution."""


class Sampler(nn.Module):
    """logits [B, V] + SamplingMetadata -> one token per row.

    Logprobs are of the raw model distribution (log_softmax of the logits before bans,
    temperature and filters), as vLLM's default `raw_logprobs`. threshold_kernel: top-k / top-p
    on CUDA through the sort-free threshold search (KernelConfig.sampling_threshold_kernel).
    """

    def __init__(self, threshold_kernel: bool = False, race_kernel: bool = False) -> None:
        super().__init__()
        self.threshold_kernel = threshold_kernel
        self.race_kernel = race_kernel
        """The draw on CUDA through the fused exponential race (kernels/sample/race.py,
        KernelConfig.sampling_race_kernel): the top-p threshold as its cut, no softmax, no
        noise tensor."""

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != md.num_rows:
            raise ValueError(f"logits must be [num_rows={md.num_rows}, vocab], "
                             f"got shape {tuple(logits.shape)}")
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]

        logits = logits.float()
        if md.banned_token_ids is not None:
            rows, toks = md.banned_token_ids  # [N], [N]
            logits = logits.index_put((rows, toks), logits.new_full((), float("-inf")))
        if md.processing is not None:
            logits = md.processing.apply(logits)
        sampled = self.sample(logits, md)  # [B]

        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        token_ids, lps, ranks = gather_logprobs(raw_logprobs, md.max_num_logprobs, sampled)
        return SamplerOutput(sampled, token_ids, lps, ranks)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """logits: [B, V] fp32 (bans applied). Returns [B] int64."""
        greedy = None
        if not md.all_random:
            greedy = logits.argmax(dim=-1)  # [B]
            if md.all_greedy:
                return greedy

        temperature = md.temperature
        if not md.all_random:
            # Greedy rows take the argmax above; keep their random branch finite.
            temperature = torch.where(is_greedy_temperature(temperature), 1.0, temperature)
        logits = logits / temperature.unsqueeze(1)
        race = self.race_kernel and logits.is_cuda
        logits, tau = filter_logits(logits, None if md.no_top_k else md.top_k,
                                    None if md.no_top_p else md.top_p,
                                    None if md.no_min_p else md.min_p, md.max_top_k,
                                    md.all_top_k, self.threshold_kernel, want_tau=race)
        if race:
            from kdaserve.kernels.sample.race import race_sample

            sampled = race_sample(logits, row_seeds(logits.shape[0], md.generators,
                                                    logits.device), tau)
        else:
            probs = torch.softmax(logits, dim=-1)  # [B, V]
            sampled = exponential_race(probs, md.generators)

        if greedy is None:
            return sampled
        return torch.where(is_greedy_temperature(md.temperature), greedy, sampled)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                  min_p: torch.Tensor | None, max_top_k: int = 0, all_top_k: bool = False,
                  threshold_kernel: bool = False, want_tau: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Top-k, top-p (apply_top_k_top_p) and min-p of tempered logits [B, V] -> (logits, tau).
    With want_tau, where apply_top_k_top_p would take the threshold search or top-k alone, the
    threshold comes back as tau [B] and those logits stay unmasked (the race keeps l >= tau
    itself); otherwise tau is None and every filter masks to -inf."""
    tau = None
    if want_tau and threshold_kernel and logits.is_cuda and uses_threshold(
            top_k, top_p, max_top_k, all_top_k, logits.shape[-1]):
        from kdaserve.kernels.sample.top_p import top_k_top_p_threshold

        logits = logits.float().contiguous()
        tau = top_k_top_p_threshold(logits, top_k, top_p)                      # [B]
    elif want_tau and top_p is None and top_k is not None:
        tau = _top_k_threshold(logits, top_k, max_top_k).squeeze(1)            # [B]
    else:
        logits = apply_top_k_top_p(logits, top_k, top_p, max_top_k, all_top_k, threshold_kernel)
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    return logits, tau


def uses_threshold(top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int,
                   all_top_k: bool, vocab: int) -> bool:
    """Whether apply_top_k_top_p (with threshold_kernel, CUDA) filters through the sort-free
    threshold search: top-p on, and not every row with a top-k below the vocabulary."""
    return top_p is not None and not (top_k is not None and all_top_k
                                      and 0 < max_top_k < vocab)


def row_seeds(num_rows: int, generators: dict[int, torch.Generator],
              device: torch.device) -> torch.Tensor:
    """[num_rows] int64 Philox keys for race_sample: a seeded row's from its own generator
    (one draw a step), the others from the global generator."""
    seeds = torch.empty(num_rows, dtype=torch.int64, device=device)
    if len(generators) < num_rows:
        seeds.random_(0, 2**62)
    for row, gen in generators.items():
        seeds[row:row + 1].random_(0, 2**62, generator=gen)
    return seeds


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int = 0,
    all_top_k: bool = False,
    threshold_kernel: bool = False,
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus of the
    renormalised top-k distribution. top_k [B] int (<= 0 = off), top_p [B] float (1 = off).
    max_top_k / all_top_k (host values) allow the partial-sort paths. Ties with the k-th logit
    are kept, except on the all_top_k path. The most likely token is never masked.
    threshold_kernel (CUDA logits only): where a full sort would run (top-p with some row
    lacking a top-k), one sort-free threshold per row instead (kernels/sample/top_p.py), which
    keeps every tie with the boundary and at most a few tokens within about one ulp below it.
    Top-k alone and top-k on every row keep torch.topk, which was measured faster there
    (benchmarks/bench_top_p.py)."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    if top_p is None:
        return _apply_top_k_only(logits, top_k, max_top_k)
    if not uses_threshold(top_k, top_p, max_top_k, all_top_k, vocab):
        return _apply_top_k_top_p_partial(logits, top_k, top_p, max_top_k)
    if threshold_kernel and logits.is_cuda:   # instead of the full sort below
        from kdaserve.kernels.sample.top_p import top_k_top_p_threshold

        tau = top_k_top_p_threshold(logits.float().contiguous(), top_k, top_p)   # [B]
        return logits.masked_fill(logits < tau.unsqueeze(1), float("-inf"))

    logits_sort, order = logits.sort(dim=-1, descending=False)  # [B, V] ascending
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab).to(torch.int64)
        kth = logits_sort.gather(1, (vocab - k).unsqueeze(1))  # [B, 1] the k-th largest
        logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))
    probs_sort = torch.softmax(logits_sort, dim=-1)
    cum = torch.cumsum(probs_sort, dim=-1)  # [B, V] ascending mass
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # keep the argmax
    logits_sort = logits_sort.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, logits_sort)


def _top_k_threshold(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """[B, 1] each row's k-th largest logit (-inf where top-k is off): keep l >= it. torch.topk
    up to the batch's largest k, no full sort."""
    vocab = logits.shape[-1]
    max_k = min(max_top_k, vocab) if max_top_k > 0 else vocab
    top_vals = logits.topk(max_k, dim=-1).values  # [B, max_k] descending
    k = top_k.clamp(min=1, max=max_k).to(torch.int64)
    kth = top_vals.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
    return kth.masked_fill((top_k <= 0).unsqueeze(1), float("-inf"))  # rows with top-k off


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k without a full sort."""
    return logits.masked_fill(logits < _top_k_threshold(logits, top_k, max_top_k),
                              float("-inf"))


def _apply_top_k_top_p_partial(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_top_k: int,
) -> torch.Tensor:
    """Top-k then top-p when every row has a top-k: sort only the batch's top max_top_k."""
    vals, idx = logits.topk(max_top_k, dim=-1)  # [B, max_k] descending
    pos = torch.arange(max_top_k, device=logits.device)
    k = torch.where(top_k > 0, top_k, max_top_k).to(torch.int64)
    vals = vals.masked_fill(pos.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    mass_above = torch.cumsum(probs, dim=-1) - probs  # [B, max_k] mass of better tokens
    drop = mass_above >= top_p.unsqueeze(1)
    drop[:, 0] = False  # keep the argmax
    vals = vals.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, idx, vals)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p * (the row's top probability).
    Uses the logit gap (p_i / p_max = exp(l_i - l_max)), so renormalisation cannot change it."""
    max_logit = logits.max(dim=-1, keepdim=True).values  # [B, 1]
    threshold = max_logit + torch.log(min_p.clamp(min=1e-38)).unsqueeze(1)
    keep = (logits >= threshold) | (min_p <= 0).unsqueeze(1)
    return logits.masked_fill(~keep, float("-inf"))


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row from probs [B, V]: argmax(p / E) with E ~ Exp(1) i.i.d. picks
    token i with probability p_i. A seeded row draws its noise only from its own generator, so
    its tokens do not depend on the rest of the batch."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, gen in generators.items():
        noise[row].exponential_(generator=gen)
    # Exp(1) can round to 0; 0/0 would be NaN, which argmax would pick.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return probs.div(noise).argmax(dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, sampled: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprobs [B, V] fp32, sampled [B] -> (token_ids [B, k+1], logprobs [B, k+1], ranks [B]).
    Column 0 is the sampled token; columns 1.. are the top-k in descending order."""
    sampled = sampled.to(torch.int64).unsqueeze(1)  # [B, 1]
    sampled_lp = logprobs.gather(1, sampled)  # [B, 1]
    ranks = (logprobs > sampled_lp).sum(dim=-1) + 1  # [B]
    if num_logprobs > 0:
        top_lp, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [B, k]
        token_ids = torch.cat([sampled, top_ids], dim=1)
        lps = torch.cat([sampled_lp, top_lp], dim=1)
    else:
        token_ids, lps = sampled, sampled_lp
    return token_ids, lps, ranks


def to_logprob_dicts(
    out: SamplerOutput, num_logprobs: list[int | None],
) -> tuple[list[dict[int, float] | None], list[dict[int, int] | None]]:
    """Host conversion, one device->host copy per tensor.

    num_logprobs[i] = row i's SamplingParams.logprobs (None = row wants none). Returns, per row,
    ({token_id: logprob} with the sampled token and the row's top-k, {token_id: 1-based rank}),
    or (None, None) for rows without logprobs. A top-k token's rank is its position; the sampled
    token's rank is counted over the whole vocab (it may sit outside the top-k).
    """
    if len(num_logprobs) != out.sampled_token_ids.shape[0]:
        raise ValueError(f"num_logprobs has {len(num_logprobs)} rows, sampler output has "
                         f"{out.sampled_token_ids.shape[0]}")
    if out.logprobs is None:
        if any(n is not None for n in num_logprobs):
            raise ValueError("rows ask for logprobs but the sampler computed none "
                             "(SamplingMetadata.max_num_logprobs was None)")
        return [None] * len(num_logprobs), [None] * len(num_logprobs)
    ids = out.logprob_token_ids.tolist()
    lps = out.logprobs.tolist()
    ranks = out.ranks.tolist()
    width = len(ids[0]) - 1
    lp_dicts: list[dict[int, float] | None] = []
    rank_dicts: list[dict[int, int] | None] = []
    for row, n in enumerate(num_logprobs):
        if n is None:
            lp_dicts.append(None)
            rank_dicts.append(None)
            continue
        if n > width:
            raise ValueError(f"row {row} asks for {n} logprobs but the sampler computed {width}")
        lp = {tok: lps[row][1 + j] for j, tok in enumerate(ids[row][1:1 + n])}
        rk = {tok: j + 1 for j, tok in enumerate(ids[row][1:1 + n])}
        sampled = ids[row][0]
        lp[sampled] = lps[row][0]
        rk[sampled] = ranks[row]
        lp_dicts.append(lp)
        rank_dicts.append(rk)
    return lp_dicts, rank_dicts
