import math

import pytest
import torch

from lab.align import infalign as I

U = I.grid(4000)


@pytest.mark.parametrize("N", [2, 4, 16])
def test_log_calibrated_rlhf_is_the_bon_policy(N):
    q = I.density(I.log_cal, 1 / (N - 1), U)
    torch.testing.assert_close(q, N * U ** (N - 1), rtol=1e-3, atol=1e-3)
    assert I.kl(q) == pytest.approx(math.log(N) - (N - 1) / N, abs=1e-5)
    assert I.win_rate(q) == pytest.approx(N / (N + 1), abs=1e-5)


def test_win_rates_of_the_base_policy_are_one_half():
    q = torch.ones(4000, dtype=torch.float64)
    for N, kind in [(1, "bon"), (4, "bon"), (4, "won"), (16, "won")]:
        assert I.win_rate(q, N, kind) == pytest.approx(0.5, abs=1e-6)
    assert I.kl(q) == 0.0


def test_bon_win_rate_against_monte_carlo():
    """BoN of the tilted policy vs BoN of the base, by sampling u directly."""
    q = I.density(I.exp_bon(3.0), 0.7, U)
    g = torch.Generator().manual_seed(0)
    n = 200_000
    u_pi = U[torch.multinomial(q, n * 4, replacement=True, generator=g)].view(n, 4).max(1).values
    u_ref = torch.rand(n, 4, generator=g, dtype=torch.float64).max(1).values
    assert I.win_rate(q, 4, "bon") == pytest.approx(float((u_pi > u_ref).double().mean()), abs=5e-3)
    u_pi = U[torch.multinomial(q, n * 4, replacement=True, generator=g)].view(n, 4).min(1).values
    u_ref = torch.rand(n, 4, generator=g, dtype=torch.float64).min(1).values
    assert I.win_rate(q, 4, "won") == pytest.approx(float((u_pi > u_ref).double().mean()), abs=5e-3)


def test_optimal_reward_for_n1_is_the_identity_shifted():
    R = I.optimal_reward(torch.ones(4000, dtype=torch.float64), 1)
    torch.testing.assert_close(R, U - 1, atol=1e-3, rtol=0)


def test_matched_kl_bisection_hits_the_budget():
    w = I.win_at_kl(I.identity, 1, "bon", 0.5)
    assert w == pytest.approx(0.774, abs=2e-3)  # the reference's analytic table


def test_transform_sign_matters():
    """The WoN claim fails with the BoN-signed transform (and vice versa)."""
    _, won_right = I.best_exp(4, "won", 0.5)
    won_wrong = max(I.win_at_kl(I.exp_bon(t), 4, "won", 0.5) for t in I.TS)
    assert won_right > won_wrong + 0.05
    assert I.exp_won(3.0)(torch.tensor([0.1, 0.9])).diff() > 0  # increasing: −exp(−t u), not exp(−t u)


def test_calibration_is_the_per_prompt_quantile_with_half_ties():
    base = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])
    got = I.calibrate(base, torch.tensor([[2.0, 5.0], [25.0, 0.0]]))
    torch.testing.assert_close(got, torch.tensor([[0.375, 1.0], [0.5, 0.0]], dtype=torch.float64))
    # invariant to a monotone map of the reward and to a per-prompt scale
    scores = torch.tensor([[2.0, 5.0], [25.0, 0.0]])
    torch.testing.assert_close(I.calibrate(base.exp(), scores.exp()), got)
    sigma = torch.tensor([[3.0], [0.01]])
    torch.testing.assert_close(I.calibrate(base * sigma, scores * sigma), got)


def test_controls_substitute_the_transform_and_the_calibration():
    u = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    torch.testing.assert_close(I.transform("bon", 5.0)(u), torch.exp(5.0 * u))
    torch.testing.assert_close(I.transform("won", 5.0)(u), -torch.exp(-5.0 * u))
    for kind in ("bon", "won"):
        torch.testing.assert_close(I.transform(kind, 5.0, "identity")(u), u)
    # under `identity` the best "exponential" is the identity itself: the BoN gain (I3) vanishes
    assert I.best_exp(4, "bon", 0.5, control="identity")[1] == pytest.approx(I.win_at_kl(I.identity, 4, "bon", 0.5))
    assert I.best_exp(4, "bon", 0.5)[1] > I.best_exp(4, "bon", 0.5, control="identity")[1] + 0.05
    # calibration: per-prompt quantiles (scale-free) vs the `raw` control's global min-max map (scale kept)
    ref = torch.full((2, 4), 0.25, dtype=torch.float64).log()
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    cal = I.calibration(ref, r)
    torch.testing.assert_close(cal[0], cal[1])
    raw = I.calibration(ref, r, "raw")
    assert float(raw.min()) == 0.0 and float(raw.max()) == 1.0 and raw[1].max() < raw[0].min() + 0.1
    with pytest.raises(ValueError, match="unknown control"):
        I.transform("bon", 1.0, "nope")
