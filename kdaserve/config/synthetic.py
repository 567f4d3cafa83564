"""Synthetic acceptance: for benchmarks with random weights only.

With random (dummy) weights a real drafter agrees with the target by chance alone, so a
speculative benchmark would measure nothing. `rejection_sample_method="synthetic"` replaces the
accept/reject *decision* with a set acceptance curve; drafts, target forward, state commit and
rollback all run as usual, so what is measured is the serving system. Emitted tokens are NOT the
model's distribution: never use it for accuracy runs. Metrics from such runs carry
`SYNTHETIC_LABEL`.

Units follow vLLM:
- synthetic_acceptance_rates: K *unconditional* per-position rates, entry j = probability that
  the first j + 1 drafts are all accepted; each in [0, 1], non-increasing.
- synthetic_acceptance_length: mean tokens emitted per verify step, counting the target's own
  (bonus / recovered) token, in [1, K + 1].

Calibration of a length L (minimum-variance schedule): a = L - 1 drafts accepted on average;
rates = [1] * floor(a) + [frac(a)] + [0] * rest, so every step accepts floor(a) drafts and one
more with probability frac(a). Mean accepted drafts = sum_j rates[j] = a exactly, since
E[accepted] = sum_j P(accepted >= j + 1). The sampler draws one u ~ U(0, 1] per request and
accepts draft j iff u <= rates[j] (a prefix, as the rates do not increase).
"""

from __future__ import annotations

import itertools
import math

SYNTHETIC_LABEL = "synthetic acceptance: for benchmarks with random weights only"


def rates_from_length(length: float, num_speculative_tokens: int) -> list[float]:
    """Minimum-variance unconditional rates whose mean acceptance length is `length`."""
    k = num_speculative_tokens
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"synthetic_acceptance_length must be in [1, {k + 1}] for "
                         f"num_speculative_tokens={k}, got {length}")
    a = length - 1.0
    full = min(math.floor(a + 1e-12), k)
    rates = [1.0] * full
    if full < k:
        rates.append(a - full)
    rates.extend([0.0] * (k - len(rates)))
    return rates


def check_rates(rates: list[float], num_speculative_tokens: int) -> list[float]:
    if len(rates) != num_speculative_tokens:
        raise ValueError(f"synthetic_acceptance_rates needs {num_speculative_tokens} entries "
                         f"(num_speculative_tokens), got {len(rates)}")
    rates = [float(r) for r in rates]
    for r in rates:
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"synthetic_acceptance_rates entries must be in [0, 1], got {r}")
    for a, b in itertools.pairwise(rates):
        if b > a:
            raise ValueError(f"synthetic_acceptance_rates must be non-increasing "
                             f"(unconditional rates), got {rates}")
    return rates


def resolve_synthetic_rates(num_speculative_tokens: int, rates: list[float] | None,
                            length: float | None) -> list[float]:
    """Exactly one of rates / length -> the unconditional per-position rates."""
    if (rates is None) == (length is None):
        raise ValueError("rejection_sample_method='synthetic' needs exactly one of "
                         "synthetic_acceptance_rates and synthetic_acceptance_length")
    if rates is not None:
        return check_rates(rates, num_speculative_tokens)
    return rates_from_length(float(length), num_speculative_tokens)
