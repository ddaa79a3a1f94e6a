import math

import pytest
import torch

from lab.core import stats as S


def test_correlations_and_p_values():
    for t in (0.3, 1.0, 4.0):  # closed forms: df = 1 is Cauchy, df = 2 has 1 − t/√(2 + t²)
        assert S.t_sf2(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), abs=1e-10)
        assert S.t_sf2(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-10)
    a = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    r, p = S.pearson(a, torch.tensor([2.0, 4.1, 5.9, 8.2, 9.9]))
    assert r > 0.99 and p < 0.001
    r, p = S.pearson(a, torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0]))
    assert r == pytest.approx(0.0) and p == pytest.approx(1.0)
    rho, _ = S.spearman(a, torch.tensor([1.0, 10.0, 100.0, 1000.0, 10000.0]))
    assert rho == pytest.approx(1.0)
    rho, _ = S.spearman(torch.tensor([1.0, 2.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert rho == pytest.approx(0.9486832980505138)  # ties take their average rank
