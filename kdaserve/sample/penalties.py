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
        for i in keep:
            bad = [t for t in (params[i].logit_bias or {}) if t >= vocab]
            if bad:
                raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary "
                                 f"[0, {vocab})")
        P = len(keep)

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        counts = torch.zeros(P, vocab, dtype=torch.float32, device=device)
        _scatter_rows(counts, [outputs[i] for i in keep], device, accumulate=True)
        prompt_mask = None
        if any(params[i].repetition_penalty != 1.0 for i in keep):
            prompt_mask = torch.zeros(P, vocab, dtype=torch.float32, device=device)
            _scatter_rows(prompt_mask, [prompts[i] for i in keep], device, accumulate=False)
            prompt_mask = prompt_mask > 0
        bias = [(rows[i], t, v) for i in keep for t, v in (params[i].logit_bias or {}).items()]
        bias_t = None
        if bias:
            r, t, v = zip(*bias)
            bias_t = (torch.tensor(r, dtype=torch.int64, device=device),
                      torch.tensor(t, dtype=torch.int64, device=device),
                      torch.tensor(v, dtype=torch.float32, device=device))
        return cls(torch.tensor([rows[i] for i in keep], dtype=torch.int64, device=device),
                   column([params[i].presence_penalty for i in keep]),
                   column([params[i].frequency_penalty for i in keep]),
                   column([params[i].repetition_penalty for i in keep]),
                   counts, prompt_mask, bias_t)

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


def logits_processing(rows, states, vocab: int, device) -> LogitsProcessing | None:
    """LogitsProcessing for worker request states (`.sampling_params`, `.token_ids` = prompt +
    outputs, `.num_prompt_tokens`); rows[i] is state i's logits row."""
    states = list(states)
    params = [s.sampling_params for s in states]
    if not any(p.processes_logits for p in params):
        return None
    return LogitsProcessing.build(list(rows), params,
                                  [s.token_ids[:s.num_prompt_tokens] for s in states],
                                  [s.token_ids[s.num_prompt_tokens:] for s in states],
                                  vocab, device)
