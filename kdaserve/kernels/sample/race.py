"""One token per row drawn from softmax over its kept logits, by an exponential race read
straight off the logits: argmax_v (l_v - log E_v), E_v ~ Exp(1) i.i.d., picks token v with
probability softmax(l)_v (the race on p_v / E_v that `sample/sampler.py exponential_race`
runs, in log space). No probabilities, no noise tensor: one pass over the logits in split
programs plus a reduce over the splits, where the torch path takes a softmax, a noise draw,
a clamp, a division and an argmax over [B, V] each.

The noise comes from Philox in the kernel, keyed by a per-row seed (`seeds`), the token index
picking the counter and word: a row's draw depends on its seed and logits only (not on the
batch, the split count or the other rows), so a row seeded from its own generator is
reproducible.

Twin: `race_sample_reference` (the same race with the same Philox stream is not reproducible
in torch; the twin takes the noise as an argument and the tests compare distributions, the
kept set and ties). No host sync: the launches depend on shapes only (CUDA-graph safe).
"""

from __future__ import annotations

import torch

from kdaserve.kernels.utils import cdiv, check_kernel_device, num_sms, require_triton

RACE_BLOCK = 1024
"""Tokens a race program scores per step (4 warps: 8 a thread)."""
RACE_MAX_SPLITS = 256
"""Splits a row at most (a power of two: the reduce takes them as one tile, whatever S is, so
a new batch size compiles nothing). Large enough that a lone row of the 163840-token
vocabulary gets one program per RACE_BLOCK slice (160 programs): a DSpark Markov position,
which walks its slice 256 tokens at a time, then runs 4 dependent steps a program, not 12."""


RACE_PROGRAMS_PER_SM = 8
"""Race programs an SM is given over the batch (fewer where the cap or the vocabulary's blocks
bind). A program walks its slice one dependent step at a time, so the SMs need several
programs each to keep loads in flight; the race kernel's sm_90 registers (48 a thread plain,
56 with the Markov tile) leave room for 9-10 programs of 4 warps an SM."""


def race_splits(B: int, V: int, sms: int) -> tuple[int, int]:
    """(splits S per row, tokens per split): about RACE_PROGRAMS_PER_SM programs per SM over
    the batch, each slice a whole number of RACE_BLOCK steps, at most RACE_MAX_SPLITS. Depends
    on shapes only."""
    blocks = cdiv(V, RACE_BLOCK)
    want = max(1, min(RACE_MAX_SPLITS, cdiv(RACE_PROGRAMS_PER_SM * sms, max(B, 1)), blocks))
    split_len = cdiv(blocks, want) * RACE_BLOCK
    return cdiv(V, split_len), split_len


def race_sample(logits: torch.Tensor, seeds: torch.Tensor, tau: torch.Tensor | None = None,
                temperature: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] fp32 with a contiguous last dim (-inf = banned); seeds [B] int64 (each
    row's Philox key); tau [B] fp32 or None: keep the tokens with logits >= tau (the top-k /
    top-p threshold, kernels/sample/top_p.py), None: every finite logit; temperature [B] fp32
    or None: the logits are divided by it first (tau is then in tempered units), and a row
    with temperature < 1e-5 takes its argmax (no noise); None: the logits are tempered
    already. Returns [B] int64: one token per row, drawn with probability softmax over the
    kept logits; 0 for a row with nothing kept."""
    _check(logits, seeds, tau, temperature)
    B, V = logits.shape
    out = torch.zeros(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    require_triton()
    check_kernel_device(logits)
    _launch(logits, seeds, tau, temperature, None, out)
    return out


MARKOV_BLOCK = 256
"""Tokens a Markov race program takes per step: its [256, rank] projection tile (rank 32: 64
values a thread at 4 warps)."""


def markov_race(logits: torch.Tensor, emb: torch.Tensor, proj: torch.Tensor,
                prev: torch.Tensor, seeds: torch.Tensor, temperature: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """One position of a DSpark Markov head in one pass: logits [B, V] fp32 (a view with a
    contiguous last dim; updated in place) += proj @ emb[prev] per row (emb, proj [V, r], the
    head's two tables; prev [B] int64, any row stride), then race_sample(logits, seeds, None,
    temperature) of the updated rows. out: [B] int64 (contiguous) to write the draws into, or
    None. Returns the draws [B]. Twin: markov_race_reference."""
    _check(logits, seeds, None, temperature)
    B, V = logits.shape
    r = emb.shape[1]
    if (emb.shape != proj.shape or emb.shape[0] != V or not emb.is_contiguous()
            or not proj.is_contiguous() or r & (r - 1)):
        raise ValueError(f"emb and proj must be contiguous [V={V}, r] with r a power of two, "
                         f"got {tuple(emb.shape)} and {tuple(proj.shape)}")
    if prev.shape != (B,) or prev.dtype != torch.int64:
        raise ValueError(f"prev must be int64 [B={B}], got {prev.dtype} {tuple(prev.shape)}")
    if out is None:
        out = torch.zeros(B, dtype=torch.int64, device=logits.device)
    if B:
        require_triton()
        check_kernel_device(logits)
        _launch(logits, seeds, None, temperature, (emb, proj, prev), out)
    return out


def markov_race_reference(logits: torch.Tensor, emb: torch.Tensor, proj: torch.Tensor,
                          prev: torch.Tensor, noise: torch.Tensor,
                          temperature: torch.Tensor) -> torch.Tensor:
    """markov_race's math in torch with the noise given: the bias as the bf16 GEMM of the
    eager head (markov_proj(markov_embed(prev)).float()) added in place, then the race."""
    logits += torch.nn.functional.linear(emb[prev], proj).float()
    return race_sample_reference(logits, noise, None, temperature)


def _launch(logits, seeds, tau, temperature, markov, out) -> None:
    from kdaserve.kernels.sample.triton_race import race_partial_kernel, race_reduce_kernel

    B, V = logits.shape
    S, split_len = race_splits(B, V, num_sms(logits.device))
    part_val = torch.empty(B, S, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(B, S, dtype=torch.int32, device=logits.device)
    emb, proj, prev = markov if markov is not None else (logits, logits, seeds)
    race_partial_kernel[(B, S)](
        logits, tau if tau is not None else logits,
        temperature if temperature is not None else logits, seeds, part_val, part_idx,
        emb, proj, prev, V, split_len, logits.stride(0), prev.stride(0),
        HAS_TAU=tau is not None, HAS_TEMP=temperature is not None, MARKOV=markov is not None,
        RANK=emb.shape[1] if markov is not None else 1,
        BLOCK=MARKOV_BLOCK if markov is not None else RACE_BLOCK, num_warps=4)
    race_reduce_kernel[(B,)](part_val, part_idx, out, S, BLOCK_S=RACE_MAX_SPLITS, num_warps=1)


def race_sample_reference(logits: torch.Tensor, noise: torch.Tensor,
                          tau: torch.Tensor | None = None,
                          temperature: torch.Tensor | None = None) -> torch.Tensor:
    """race_sample's math with the Exp(1) noise given ([B, V], > 0): argmax over the kept
    tokens of l / T - log(noise) (l alone on rows with T < 1e-5), the lowest index among
    equal scores; 0 where nothing is kept."""
    log_noise = noise.log()
    if temperature is not None:
        greedy = temperature < 1e-5
        logits = logits / torch.where(greedy, 1.0, temperature)[:, None]
        log_noise = torch.where(greedy[:, None], 0.0, log_noise)
    keep = logits > float("-inf")
    if tau is not None:
        keep &= logits >= tau[:, None]
    score = torch.where(keep, logits - log_noise, float("-inf"))
    return score.argmax(dim=-1)


def _check(logits: torch.Tensor, seeds: torch.Tensor, tau: torch.Tensor | None,
           temperature: torch.Tensor | None) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or (
            logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits must be fp32 [B, V] with a contiguous last dim, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    B = logits.shape[0]
    if logits.shape[1] < 1:
        raise ValueError(f"logits must have a vocabulary of at least 1, got {logits.shape[1]}")
    if seeds.shape != (B,) or seeds.dtype != torch.int64 or seeds.device != logits.device:
        raise ValueError(f"seeds must be int64 [B={B}] on {logits.device}, got {seeds.dtype} "
                         f"{tuple(seeds.shape)} on {seeds.device}")
    for name, t in (("tau", tau), ("temperature", temperature)):
        if t is not None and (t.shape != (B,) or t.dtype != torch.float32
                              or t.device != logits.device):
            raise ValueError(f"{name} must be fp32 [B={B}] on {logits.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")


__all__ = ["markov_race", "markov_race_reference", "race_sample", "race_sample_reference",
           "race_splits"]
