import math

import pytest
import torch

from lab.interp import emi as E


def gaussian_pairs(rho: float, n: int = 3000, d: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = rho * x + math.sqrt(1 - rho**2) * torch.randn(n, d, generator=g)
    return x, y


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.7])
def test_club_against_the_closed_form_gaussian_case(rho):
    """For y = ρx + √(1−ρ²)ε the true MI is −(d/2)·log(1−ρ²); CLUB with the exact conditional equals
    d·ρ²/(1−ρ²) (≥ MI, equality only at ρ = 0). A trained CLUB must land there."""
    d = 2
    x, y = gaussian_pairs(rho, d=d)
    club = E.fit_club(x, y, hidden=32, steps=800, lr=5e-3, batch_size=256, quiet=True)
    xt, yt = gaussian_pairs(rho, n=1500, d=d, seed=1)  # held-out pairs
    with torch.no_grad():
        est = club(xt, yt).item()
    club_exact, mi = d * rho**2 / (1 - rho**2), -d / 2 * math.log(1 - rho**2)
    assert est == pytest.approx(club_exact, abs=0.06 + 0.12 * club_exact)
    assert est >= mi - 0.06


def test_emi_and_emid_signs():
    x, y = gaussian_pairs(0.7)
    club = E.fit_club(x, y, hidden=32, steps=500, lr=5e-3, batch_size=256, quiet=True)
    shuffled = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(0))]
    # responses unrelated to their queries carry less query information than the references
    assert E.emi(club, x, shuffled, y) < -0.5
    assert E.emi(club, x, y, y) == 0.0
    assert E.emid(0.01, -0.2) == pytest.approx(0.21)  # ID minus OOD: positive = degradation


def test_von_neumann_entropy_and_jsd():
    assert E.von_neumann_entropy(torch.eye(4)) == pytest.approx(math.log(4))
    assert E.von_neumann_entropy(torch.diag(torch.tensor([1.0, 0.0, -1e-9]))) == pytest.approx(0.0)
    g = torch.Generator().manual_seed(0)
    A = torch.nn.functional.normalize(torch.randn(200, 8, generator=g), dim=1)
    B = torch.nn.functional.normalize(torch.randn(200, 8, generator=g) + 2 * torch.eye(8)[0], dim=1)
    assert abs(E.jsd_cov(A, A)) < 1e-10
    assert E.jsd_cov(A, B) == pytest.approx(E.jsd_cov(B, A), abs=1e-12) and E.jsd_cov(A, B) > 0.01
    # the repo's form weights sets by size; the normalised one does not
    twice = torch.cat([A, A])
    assert abs(E.jsd_cov(A, twice, normalise=True)) < 1e-10 and abs(E.jsd_cov(A, twice)) < 1e-10
    assert E.jsd_cov(twice, B) != pytest.approx(E.jsd_cov(twice, B, normalise=True))


def test_upper_bound_by_hand():
    assert E.upper_bound(0.04, 0.09, 0.0625, 0.0016) == pytest.approx(0.2 + 0.3 + 0.5 + 0.2)
    assert E.upper_bound(0.04, 0.09, 0.0625, 0.0016, entropy_scale=2.0) == pytest.approx(2 * 0.5 + 4 * 0.7)
    assert sum(E.bound_terms(0.04, 0.09, 0.0625, 0.0016).values()) == pytest.approx(1.2)
    assert E.upper_bound(-1e-12, 0.0, 0.0, 0.0) == 0.0  # round-off below zero is clipped
