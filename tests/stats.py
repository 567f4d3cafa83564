"""Statistics shared by the sampling tests."""

import torch


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of counts [V] against probs [V] (any device); cells
    with expected < 5 are pooled into one, cells with expected 0 dropped."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    exp = probs * counts.sum()
    big = exp >= 5
    obs_c = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp_c = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = exp_c > 0
    obs_c, exp_c = obs_c[keep], exp_c[keep]
    stat = ((obs_c - exp_c) ** 2 / exp_c).sum()
    df = obs_c.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))
