"""Interpreter checks of the exponential race (kernels/sample/race.py), fp32 on the CPU; run by
test_race_sample.py in a subprocess with TRITON_INTERPRET=1, and recorded for the sm_90 compile
test. Each check is deterministic (fixed seeds), so a wrong draw fails every run."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_checks  # noqa: E402

kernel_checks.patch_triton_interpreter()

from kdaserve.kernels.sample.race import (markov_race, markov_race_reference,  # noqa: E402
                                          race_sample, race_sample_reference)
from kdaserve.kernels.sample.softmax import softmax_reference, tempered_softmax  # noqa: E402
from tests.stats import chi2_pvalue  # noqa: E402

INF = float("inf")


def check_distribution() -> None:
    """1200 draws of one row (1200 rows, distinct seeds): the counts follow softmax over the
    kept tokens; tokens below tau and -inf are never drawn (the GPU test draws more, with and
    without tau)."""
    n = 1200
    row = torch.tensor([0.5, -1.0, 2.0, -INF, 1.0, 0.0, -3.0, 1.5])
    logits = row.repeat(n, 1)
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 11
    got = race_sample(logits, seeds, torch.full((n,), 0.0))
    keep = row >= 0.0
    probs = torch.softmax(torch.where(keep, row, -INF), 0)
    counts = torch.bincount(got, minlength=row.numel())
    assert (counts[~keep] == 0).all(), counts
    p = chi2_pvalue(counts, probs)
    assert p > 1e-4, (counts.tolist(), probs.tolist(), p)


def check_rows_independent() -> None:
    """A row's draw depends on its seed and logits only: the same in a batch of 5 as alone,
    across split counts (V spans several blocks and splits), and again with the same seeds."""
    torch.manual_seed(0)
    V = 5000
    logits = torch.randn(5, V) * 0.1
    logits[2, 100:] = -INF                                   # few tokens kept
    seeds = torch.tensor([3, 99, 12345, 2**40 + 7, 5], dtype=torch.int64)
    tau = torch.tensor([-INF, 0.05, -INF, 0.1, 0.2])
    batch = race_sample(logits, seeds, tau)
    assert torch.equal(batch, race_sample(logits, seeds, tau))
    for i in range(5):
        alone = race_sample(logits[i:i + 1].clone(), seeds[i:i + 1], tau[i:i + 1])
        assert alone.item() == batch[i].item(), (i, alone, batch)
        assert logits[i, batch[i]] >= tau[i] and batch[i] < (100 if i == 2 else V)
    other = race_sample(logits, seeds + 1, tau)
    assert not torch.equal(other, batch)                     # new seeds, new draws


def check_edges() -> None:
    """A dominant logit always wins; a row with nothing kept gives 0; a strided batch (rows
    of a wider tensor) reads its rows; one token; against the reference with its own noise:
    the same winner for noise that makes one token clearly best."""
    V = 3000
    logits = torch.zeros(3, V)
    logits[0, 2047] = 60.0
    logits[1] = -INF
    logits[2, 17] = 60.0
    seeds = torch.tensor([1, 2, 3], dtype=torch.int64)
    assert race_sample(logits, seeds).tolist() == [2047, 0, 17]
    wide = torch.zeros(3, V + 5)
    wide[:, :V] = logits
    assert race_sample(wide[:, :V], seeds).tolist() == [2047, 0, 17]
    assert race_sample(torch.zeros(2, 1), seeds[:2]).tolist() == [0, 0]
    noise = torch.ones(3, V)
    noise[:, 5] = 1e-30                                      # token 5 wins unless masked out
    want = race_sample_reference(logits, noise)
    assert want.tolist() == [5, 0, 5], want


def check_temperature() -> None:
    """With temperatures: a T = 0 row takes its argmax whatever its seed; a tempered row's
    draws follow softmax(l / T) (600 draws, T = 2 flattens the row's preference)."""
    V = 1500
    logits = torch.linspace(-1.0, 1.0, V).repeat(2, 1)
    logits[0, 700] = 5.0
    temps = torch.tensor([0.0, 1.0])
    for seed in range(3):
        got = race_sample(logits, torch.tensor([seed, seed + 9], dtype=torch.int64), None, temps)
        assert got[0].item() == 700, got
    n = 600
    row = torch.tensor([1.0, 0.0, -1.0, 2.0])
    got = race_sample(row.repeat(n, 1), torch.arange(n, dtype=torch.int64) + 5, None,
                      torch.full((n,), 2.0))
    probs = torch.softmax(row / 2.0, 0)
    assert chi2_pvalue(torch.bincount(got, minlength=4), probs) > 1e-4
    noise = torch.ones(2, V)
    noise[:, 3] = 1e-30
    want = race_sample_reference(logits, noise, None, temps)
    assert want.tolist() == [700, 3], want


def check_softmax() -> None:
    """The split softmax against torch's: plain, tempered with a greedy row (one-hot at its
    id), masked tokens, a strided batch over several splits, one token."""
    torch.manual_seed(5)
    V = 5000
    logits = torch.randn(4, V) * 3
    logits[1, ::3] = -INF
    wide = torch.zeros(4, V + 7)
    wide[:, :V] = logits
    for lg in (logits, wide[:, :V]):
        torch.testing.assert_close(tempered_softmax(lg), softmax_reference(lg), rtol=1e-5,
                                   atol=1e-7)
    temps = torch.tensor([0.7, 0.0, 1.0, 2.5])
    ids = torch.tensor([5, 4998, 0, 17])
    got = tempered_softmax(logits, temps, ids)
    torch.testing.assert_close(got, softmax_reference(logits, temps, ids), rtol=1e-5, atol=1e-7)
    assert got[1, 4998] == 1.0 and got[1].sum() == 1.0
    assert (tempered_softmax(logits)[1, ::3] == 0).all()       # masked tokens get 0
    torch.testing.assert_close(tempered_softmax(torch.zeros(2, 1)), torch.ones(2, 1))


def check_markov() -> None:
    """A Markov head position: the logits gain the bias of each row's previous token (the
    eager head's bf16 product, to within its rounding) in place, greedy rows (T = 0) draw the
    argmax of the updated logits, sampled rows follow their softmax (1000 draws of one row,
    the previous token read with a row stride), and the draws land in `out`."""
    torch.manual_seed(6)
    V, r = 600, 32
    emb = (torch.randn(V, r) * 0.5).bfloat16()
    proj = (torch.randn(V, r) * 0.5).bfloat16()
    base = torch.randn(3, V)
    prev = torch.tensor([[5, 0], [599, 0], [17, 0]])[:, 0]               # row stride 2
    temps = torch.tensor([0.0, 0.0, 0.0])
    got_logits = base.clone()
    out = torch.full((3,), -1, dtype=torch.int64)
    got = markov_race(got_logits, emb, proj, prev, torch.zeros(3, dtype=torch.int64), temps,
                      out=out)
    want_logits = base.clone()
    want = markov_race_reference(want_logits, emb, proj, prev, torch.ones(3, V), temps)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0.05)
    assert got is out and torch.equal(got, got_logits.argmax(-1)), (got, want)
    n = 1000
    row_logits = torch.tensor([1.0, 0.0, -1.0, 0.5]).repeat(n, 1)
    e4, p4 = torch.zeros(4, 8).bfloat16(), torch.zeros(4, 8).bfloat16()
    e4[2, 0], p4[:, 0] = 1.0, torch.tensor([0.0, 1.0, 0.0, -1.0]).bfloat16()  # bias of token 2
    draws = markov_race(row_logits, e4, p4, torch.full((n,), 2, dtype=torch.int64),
                        torch.arange(n, dtype=torch.int64) + 3, torch.full((n,), 1.0))
    updated = torch.tensor([1.0, 1.0, -1.0, -0.5])
    assert torch.equal(row_logits[0], updated)
    assert chi2_pvalue(torch.bincount(draws, minlength=4), torch.softmax(updated, 0)) > 1e-4


if __name__ == "__main__":
    check_markov()
    check_softmax()
    check_temperature()
    check_distribution()
    check_rows_independent()
    check_edges()
    print("race checks passed")
