"""N-gram (prompt lookup) proposer: drafts are copied from earlier in the request's own tokens.

For each request: find the longest n (prompt_lookup_max down to prompt_lookup_min) such that the
last n tokens of prompt + output occur earlier in the sequence; take the most recent such earlier
occurrence and propose up to K tokens that followed it (fewer when the sequence ends first). No
match -> no drafts. Drafts are deterministic, so the rejection sampler treats them as one-hot.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1,
                 prompt_lookup_max: int = 4) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({prompt_lookup_max}) must be >= "
                             f"prompt_lookup_min ({prompt_lookup_min})")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_one(self, token_ids: np.ndarray | list[int], k: int | None = None) -> list[int]:
        """Drafts for one sequence (prompt + output), at most k (default K)."""
        k = self.k if k is None else k
        tokens = np.asarray(token_ids, dtype=np.int64)
        L = tokens.shape[0]
        if k <= 0 or L < self.min_n + 1:
            return []
        end, n = longest_suffix_match(tokens, self.min_n, self.max_n)
        if n == 0:
            return []
        return tokens[end + 1:end + 1 + k].tolist()

    def propose(self, token_ids: list[list[int]] | list[np.ndarray],
                max_drafts: list[int] | None = None) -> list[list[int]]:
        """Drafts per request. max_drafts[i] caps request i's count (e.g. tokens left before
        max_tokens / max_model_len); None = K for all."""
        if max_drafts is None:
            return [self.propose_one(t) for t in token_ids]
        if len(max_drafts) != len(token_ids):
            raise ValueError(f"max_drafts has {len(max_drafts)} entries for "
                             f"{len(token_ids)} requests")
        return [self.propose_one(t, min(self.k, m)) for t, m in zip(token_ids, max_drafts)]


def longest_suffix_match(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """(end, n): the suffix tokens[L-n:] also ends at index end < L - 1 (so at least one token
    follows it), n is the largest such length in [min_n, max_n], and end is the most recent
    occurrence of that length. (0, 0) when no suffix of length >= min_n recurs.

    Vectorised over candidate end positions: match[e] counts j = 0.. while
    tokens[e - j] == tokens[L - 1 - j], capped at max_n."""
    L = tokens.shape[0]
    ends = np.arange(L - 1)                                  # candidate ends, each followed
    alive = tokens[:L - 1] == tokens[L - 1]                  # j = 0
    length = alive.astype(np.int64)
    for j in range(1, min(max_n, L - 1)):
        ok = ends >= j
        same = np.zeros(L - 1, dtype=bool)
        same[ok] = tokens[ends[ok] - j] == tokens[L - 1 - j]
        alive &= same
        if not alive.any():
            break
        length += alive
    best = int(length.max(initial=0))
    if best < min_n:
        return 0, 0
    end = int(np.flatnonzero(length == best)[-1])
    return end, best
