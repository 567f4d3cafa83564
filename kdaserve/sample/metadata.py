"""Per-step sampling inputs: one row per request in the batch, as device tensors.

The model runner builds a `SamplingMetadata` each step (later from persistent buffers). Host-side
flags let the common cases (all greedy, no top-k/top-p/min-p, no logprobs) skip work without a
device sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from kdaserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kdaserve.sample.penalties import LogitsProcessing

_SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (same rule as SamplingParams.greedy)."""


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor
    """[B] fp32; 0 (anything < 1e-5) marks a greedy row."""
    top_p: torch.Tensor
    """[B] fp32; 1.0 = off."""
    top_k: torch.Tensor
    """[B] int32; <= 0 = off."""
    min_p: torch.Tensor
    """[B] fp32; 0.0 = off."""
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    """Row -> generator for seeded random rows; other rows draw from the default generator."""

    all_greedy: bool = False
    all_random: bool = False
    no_top_p: bool = True
    no_top_k: bool = True
    no_min_p: bool = True
    max_top_k: int = 0
    """Largest top-k of any random row (0 when no_top_k): lets batches use torch.topk."""
    all_top_k: bool = False
    """Every random row has top-k on: top-p then only needs to sort the top max_top_k."""

    max_num_logprobs: int | None = None
    """Largest `logprobs` of any row; None = no row wants logprobs."""

    banned_token_ids: torch.Tensor | None = None
    """[2, N] int64 (row, token) pairs whose logits are forced to -inf before sampling (stop
    tokens of rows still under min_tokens). None = nothing banned."""

    processing: "LogitsProcessing | None" = None
    """Penalties and logit_bias of the rows that use them (sample/penalties.py), applied after
    the bans; None = no row uses them."""

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: dict[int, torch.Generator] | None = None,
        banned: Iterable[tuple[int, int]] | None = None,
        device: torch.device | str = "cpu",
    ) -> "SamplingMetadata":
        """Build the tensors for a batch whose row i samples with params[i].

        generators: row -> torch.Generator on `device` for seeded rows (the runner owns them so
        they persist across steps). banned: (row, token_id) pairs to mask, e.g. from
        `min_tokens_banned_ids`.
        """
        if len(params) == 0:
            raise ValueError("SamplingMetadata.build needs at least one row, got 0 params")
        generators = dict(generators or {})
        for row in generators:
            if not 0 <= row < len(params):
                raise ValueError(f"generator row {row} out of range for {len(params)} rows")

        greedy = [p.greedy for p in params]
        temps, top_ps, top_ks, min_ps = row_values(params)
        # Greedy rows ignore the filters: leave them off so flags stay cheap.
        random_rows = [p for p, g in zip(params, greedy) if not g]
        no_top_k = all(p.top_k <= 0 for p in random_rows)
        no_top_p = all(p.top_p >= 1.0 for p in random_rows)
        no_min_p = all(p.min_p <= 0.0 for p in random_rows)
        wanted = [p.logprobs for p in params if p.logprobs is not None]

        banned_t = None
        pairs = list(banned or [])
        if pairs:
            for row, tok in pairs:
                if not 0 <= row < len(params) or tok < 0:
                    raise ValueError(f"banned (row, token) pair {(row, tok)} out of range "
                                     f"for {len(params)} rows")
            banned_t = _to_device(torch.tensor(pairs, dtype=torch.int64).T.contiguous(), device)

        temperature, top_p, top_k, min_p = _row_tensors(temps, top_ps, top_ks, min_ps, device)
        return cls(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            generators=generators,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_top_p=no_top_p,
            no_top_k=no_top_k,
            no_min_p=no_min_p,
            max_top_k=0 if no_top_k else max(p.top_k for p in random_rows),
            all_top_k=bool(random_rows) and all(p.top_k > 0 for p in random_rows),
            max_num_logprobs=max(wanted) if wanted else None,
            banned_token_ids=banned_t,
        )


def row_values(params: Sequence[SamplingParams]
               ) -> tuple[list[float], list[float], list[int], list[float]]:
    """Each row's (temperature, top_p, top_k, min_p) as the sampler reads them: temperature 0
    on a greedy row, top_k 0 where it is off."""
    return ([0.0 if p.greedy else p.temperature for p in params], [p.top_p for p in params],
            [p.top_k if p.top_k > 0 else 0 for p in params], [p.min_p for p in params])


def _row_tensors(temps: list[float], top_ps: list[float], top_ks: list[int],
                 min_ps: list[float], device: torch.device | str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_p, top_k, min_p) on device from two host->device copies: on CUDA
    pinned staging copied without blocking, instead of four pageable copies that each make the
    host wait for the device (a visible share of a batch-1 step's host time).
    The rows are padded to a multiple of 4 floats so that every row starts 16-byte aligned
    whatever the batch size: Triton specialises pointer arguments on 16-byte alignment, and
    top_p at offset 4 * B bytes made the threshold kernels compile a second variant in the
    middle of serving the first time B was a multiple of 4 (seen in benchmarks/first_steps.py)."""
    B = len(temps)
    pad = [0.0] * (-B % 4)
    rows = [temps + pad, top_ps + pad, min_ps + pad]
    floats = _to_device(torch.tensor(rows, dtype=torch.float32), device)[:, :B]   # [3, B]
    ints = _to_device(torch.tensor(top_ks, dtype=torch.int32), device)
    return floats[0], floats[1], ints, floats[2]


def _to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on device; to CUDA through pinned staging without blocking the host (the
    copy queues behind the stream's work instead of waiting for it)."""
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def min_tokens_banned_ids(
    params: Sequence[SamplingParams],
    num_output_tokens: Sequence[int],
    eos_token_ids: Iterable[int] | int | None,
) -> list[tuple[int, int]]:
    """(row, token) pairs to ban: a row with fewer than min_tokens outputs may not emit a token
    that would end it: its stop_token_ids, and EOS unless ignore_eos (then EOS ends nothing and is
    an ordinary token), as vLLM. Not for a structured-output row: its grammar decides when stop
    tokens may come (once complete it allows nothing else; a ban would leave no token at all),
    and a stop token before min_tokens does not end the request."""
    if len(params) != len(num_output_tokens):
        raise ValueError(f"params has {len(params)} rows but num_output_tokens has "
                         f"{len(num_output_tokens)}")
    if eos_token_ids is None:
        eos = set()
    elif isinstance(eos_token_ids, int):
        eos = {eos_token_ids}
    else:
        eos = set(eos_token_ids)
    pairs: list[tuple[int, int]] = []
    for row, (p, n_out) in enumerate(zip(params, num_output_tokens)):
        if n_out < p.min_tokens and p.structured_outputs is None:
            stops = p.all_stop_token_ids if p.ignore_eos else eos | p.all_stop_token_ids
            pairs.extend((row, tok) for tok in sorted(stops))
    return pairs


def is_greedy_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows that sample greedily."""
    return temperature < _SAMPLING_EPS
