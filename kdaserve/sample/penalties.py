"""Presence / frequency / repetition penalties and logit_bias (vLLM's semantics and order:
logit_bias, then the repetition penalty over prompt + output tokens, then the frequency and
presence penalties over output tokens; all before temperature and the top-k/p filters)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kdaserve.sampling_params import SamplingParams


@dataclass
class LogitsProcessing:
    """The logits rows whose requests use penalties or logit_bias (other rows are untouched)."""

    rows: torch.Tensor
    """[P] int64 rows of the logits."""
    presence: torch.Tensor
    """[P, 1] fp32."""
    frequency: torch.Tensor
    """[P, 1] fp32."""
    repetition: torch.Tensor
    """[P, 1] fp32 (1 = off)."""
    output_counts: torch.Tensor
    """[P, V] fp32: occurrences of each token in the row's output so far."""
    prompt_mask: torch.Tensor | None
    """[P, V] bool: the token occurs in the prompt (None when no row has a repetition penalty)."""
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    """(logits rows [N], token ids [N], values [N]) or None."""

    @classmethod
    def build(cls, rows: Sequence[int], params: Sequence[SamplingParams],
              prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], vocab: int,
              device: torch.device | str) -> "LogitsProcessing | None":
        """rows[i]: the logits row of request i, which samples with params[i] after
        prompts[i] + outputs[i]. Requests without penalties or bias are skipped; None when
        none is left."""
        keep = [i for i, p in enumerate(params) if p.processes_logits]
        if not keep:
            return None
        _check_bias([params[i] for i in keep], vocab)
        P = len(keep)
        counts = torch.zeros(P, vocab, dtype=torch.float32, device=device)
        _scatter_rows(counts, [outputs[i] for i in keep], device, accumulate=True)
        prompt_mask = None
        if any(params[i].repetition_penalty != 1.0 for i in keep):
            prompt_mask = torch.zeros(P, vocab, dtype=torch.float32, device=device)
            _scatter_rows(prompt_mask, [prompts[i] for i in keep], device, accumulate=False)
            prompt_mask = prompt_mask > 0
        return cls.from_counts([rows[i] for i in keep], [params[i] for i in keep], counts,
                               prompt_mask, device)

    @classmethod
    def from_counts(cls, rows: Sequence[int], params: Sequence[SamplingParams],
                    output_counts: torch.Tensor, prompt_mask: torch.Tensor | None,
                    device: torch.device | str) -> "LogitsProcessing":
        """rows / params of the requests that process logits only; output_counts [P, V] and
        prompt_mask [P, V] (None when no row has a repetition penalty) in the same order."""
        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        bias = [(r, t, v) for r, p in zip(rows, params) for t, v in (p.logit_bias or {}).items()]
        bias_t = None
        if bias:
            r, t, v = zip(*bias)
            bias_t = (torch.tensor(r, dtype=torch.int64, device=device),
                      torch.tensor(t, dtype=torch.int64, device=device),
                      torch.tensor(v, dtype=torch.float32, device=device))
        return cls(torch.tensor(list(rows), dtype=torch.int64, device=device),
                   column([p.presence_penalty for p in params]),
                   column([p.frequency_penalty for p in params]),
                   column([p.repetition_penalty for p in params]),
                   output_counts, prompt_mask, bias_t)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] fp32 -> processed copy."""
        logits = logits.clone()
        if self.bias is not None:
            r, t, v = self.bias
            logits.index_put_((r, t), v, accumulate=True)
        sub = logits[self.rows]                                        # [P, V]
        seen_out = self.output_counts > 0
        if self.prompt_mask is not None:
            seen = self.prompt_mask | seen_out
            rep = self.repetition
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - self.frequency * self.output_counts - self.presence * seen_out.float()
        logits[self.rows] = sub
        return logits


def _check_bias(params: Sequence[SamplingParams], vocab: int) -> None:
    for p in params:
        bad = [t for t in (p.logit_bias or {}) if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab})")


def _scatter_rows(dst: torch.Tensor, token_lists: Sequence[Sequence[int]],
                  device: torch.device | str, accumulate: bool) -> None:
    """dst[i, t] += 1 (or = 1) for every token t of token_lists[i]; one H2D copy."""
    lens = [len(t) for t in token_lists]
    if not sum(lens):
        return
    toks = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(len(lens), device=device),
                                   torch.tensor(lens, device=device))
    ones = torch.ones_like(toks, dtype=dst.dtype)
    dst.index_put_((rows, toks), ones, accumulate=accumulate)


class PenaltyCache:
    """Per-request device rows the penalties need, kept across steps: the prompt's token mask
    (built once) and the output token counts (updated with each step's new tokens only), so a
    step never copies a whole prompt or output to the device again. The runner frees a
    request's rows when it finishes or is preempted."""

    def __init__(self, vocab: int, device: torch.device | str) -> None:
        self.vocab = vocab
        self.device = device
        self._counts: dict[str, tuple[torch.Tensor, int]] = {}
        """req_id -> (output counts [V] fp32, output tokens counted so far)."""
        self._prompt: dict[str, torch.Tensor] = {}
        """req_id -> prompt mask [V] bool."""

    def output_counts(self, req_id: str, output: Sequence[int]) -> torch.Tensor:
        counts, done = self._counts.get(req_id) or (
            torch.zeros(self.vocab, dtype=torch.float32, device=self.device), 0)
        new = output[done:]
        if new:
            _scatter_rows(counts.view(1, -1), [new], self.device, accumulate=True)
        self._counts[req_id] = (counts, len(output))
        return counts

    def prompt_mask(self, req_id: str, prompt: Sequence[int]) -> torch.Tensor:
        mask = self._prompt.get(req_id)
        if mask is None:
            rows = torch.zeros(1, self.vocab, dtype=torch.float32, device=self.device)
            _scatter_rows(rows, [prompt], self.device, accumulate=False)
            mask = self._prompt[req_id] = rows[0] > 0
        return mask

    def free(self, req_id: str) -> None:
        self._counts.pop(req_id, None)
        self._prompt.pop(req_id, None)


def logits_processing(rows, states, cache: PenaltyCache) -> LogitsProcessing | None:
    """LogitsProcessing for worker request states (`.req_id`, `.sampling_params`, `.token_ids`
    = prompt + outputs, `.num_prompt_tokens`); rows[i] is state i's logits row."""
    picked = [(r, s) for r, s in zip(rows, states) if s.sampling_params.processes_logits]
    if not picked:
        return None
    _check_bias([s.sampling_params for _, s in picked], cache.vocab)
    counts = torch.stack([cache.output_counts(s.req_id, s.token_ids[s.num_prompt_tokens:])
                          for _, s in picked])                              # [P, V]
    prompt_mask = None
    if any(s.sampling_params.repetition_penalty != 1.0 for _, s in picked):
        prompt_mask = torch.stack([cache.prompt_mask(s.req_id, s.token_ids[:s.num_prompt_tokens])
                                   for _, s in picked])                     # [P, V]
    return LogitsProcessing.from_counts([r for r, _ in picked],
                                        [s.sampling_params for _, s in picked], counts,
                                        prompt_mask, cache.device)
