"""Statistics shared by the sampling tests."""

import torch


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of counts [V] against probs [V] (any device); cells
    with expected < 5 are pooled into one; 0 if a draw has probability 0, 1 when only one cell
    is possible."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    if counts[probs == 0].sum() > 0:
        return 0.0   # a draw the distribution cannot produce
    exp = probs * counts.sum()
    big = exp >= 5
    obs_c = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp_c = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = exp_c > 0
    obs_c, exp_c = obs_c[keep], exp_c[keep]
    stat = ((obs_c - exp_c) ** 2 / exp_c).sum()
    df = obs_c.numel() - 1
    if df == 0:
        return 1.0   # one possible outcome, and every draw is it
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))
