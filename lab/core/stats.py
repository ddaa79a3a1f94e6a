"""Correlation statistics without SciPy: Pearson and Spearman with two-sided t-test p-values."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) by its continued fraction (modified Lentz)."""
    if x <= 0 or x >= 1:
        return float(x >= 1)
    if x > (a + 1) / (a + b + 2):
        return 1 - _betainc(b, a, 1 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2:
            num = -((a + m) * (a + b + m) * x) / ((a + 2 * m) * (a + 2 * m + 1))
        else:
            num = (m * (b - m) * x) / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1 + num * d
        d = 1 / (d if abs(d) > 1e-300 else 1e-300)
        c = 1 + num / (c if abs(c) > 1e-300 else 1e-300)
        f *= c * d
        if abs(c * d - 1) < 1e-14:
            break
    return front * (f - 1)


def t_sf2(t: float, df: int) -> float:
    """Two-sided tail P(|T| > |t|) of Student's t with `df` degrees of freedom."""
    return _betainc(df / 2, 0.5, df / (df + t * t))


def pearson(a: Tensor, b: Tensor) -> tuple[float, float]:
    """Pearson r and its two-sided p-value (t test with n − 2 degrees of freedom)."""
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    r = float((a * b).sum() / (a.norm() * b.norm()))
    n = len(a)
    if abs(r) >= 1 or n < 3:
        return r, 0.0 if abs(r) >= 1 else 1.0
    return r, t_sf2(r * math.sqrt((n - 2) / (1 - r * r)), n - 2)


def spearman(a: Tensor, b: Tensor) -> tuple[float, float]:
    """Spearman ρ (Pearson on average ranks) and the same t-test p-value."""
    return pearson(_ranks(a), _ranks(b))


def _ranks(v: Tensor) -> Tensor:
    order = v.argsort()
    ranks = torch.empty(len(v), dtype=torch.float64)
    ranks[order] = torch.arange(len(v), dtype=torch.float64)
    for value in v.unique():  # ties share their average rank
        tie = v == value
        ranks[tie] = ranks[tie].mean()
    return ranks
