import math

import pytest
import torch

from lab.align import infalign as I

U = I.grid(4000)


@pytest.mark.parametrize("N", [2, 4, 16])
def test_log_calibrated_rlhf_is_the_bon_policy(N):
    q = I.density(I.log_cal, 1 / (N - 1), U)
    torch.testing.assert_close(q, N * U ** (N - 1), rtol=1e-3, atol=1e-3)
    assert I.kl_to_base(q) == pytest.approx(math.log(N) - (N - 1) / N, abs=1e-5)
    assert I.win_rate(q) == pytest.approx(N / (N + 1), abs=1e-5)


def test_win_rates_of_the_base_policy_are_one_half():
    q = torch.ones(4000, dtype=torch.float64)
    for N, kind in [(1, "bon"), (4, "bon"), (4, "won"), (16, "won")]:
        assert I.win_rate(q, N, kind) == pytest.approx(0.5, abs=1e-6)
    assert I.kl_to_base(q) == 0.0


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


def test_kl_to_base_is_the_kl_of_the_tilted_policy_to_the_base():
    """On a density of the calibrated reward, KL(q ‖ U[0, 1]) = KL(π ‖ π_ref): checked against q(u) = 2u
    (Best-of-2), whose KL ∫ 2u log 2u du = log 2 − 1/2 by hand."""
    assert I.kl_to_base(2 * U) == pytest.approx(math.log(2) - 0.5, abs=1e-6)
    assert I.kl_to_base(torch.ones(10, dtype=torch.float64)) == 0.0


def test_bon_policy_check_reports_the_log_tilt_beside_the_bon_closed_forms():
    got = I.bon_policy_check(U, (2, 8))
    assert list(got) == [2, 8]
    for N, c in got.items():
        assert c["kl_bon"] == pytest.approx(math.log(N) - (N - 1) / N) and c["win_bon"] == pytest.approx(N / (N + 1))
        assert c["kl"] == pytest.approx(c["kl_bon"], abs=1e-5) and c["win"] == pytest.approx(c["win_bon"], abs=1e-5)
    assert [I.setting_name("bon", 1), I.setting_name("won", 4)] == ["standard", "WON-4"]


def test_the_n1_optimum_frontier_meets_the_identity_at_matched_kl():
    """Two independent routes to the N = 1 win rate at KL 0.5: the fixed-point frontier (interpolated) and the
    identity's bisection on β (the optimal transformed reward for N = 1 is the identity)."""
    from dataclasses import replace

    cfg = replace(I.Config(), M_opt=1000, opt_iters=300, frontier_settings=(("bon", 1),), budgets=(0.5,))
    kls, wins = I.optimum_frontier(1, "bon", torch.logspace(*cfg.opt_betas, dtype=torch.float64), M=1000, iters=300)
    assert kls.shape == (25,) and (kls.diff() < 0).all()  # KL falls as β grows
    got = I.optima(cfg)
    assert list(got) == [("standard", 0.5)] and got["standard", 0.5] == I.at_kl(kls, wins, 0.5)
    assert got["standard", 0.5] == pytest.approx(I.win_at_kl(I.identity, 1, "bon", 0.5), abs=5e-3)


def test_tilt_frontier_agrees_with_the_matched_kl_bisection_and_the_curves():
    from dataclasses import replace

    u = I.grid(1000)
    kls, wins = I.tilt_frontier(I.exp_bon(5.0), torch.logspace(-3, 2, 400, dtype=torch.float64), 4, "bon", u)
    assert I.at_kl(kls, wins, 0.5) == pytest.approx(I.win_at_kl(I.exp_bon(5.0), 4, "bon", 0.5, M=1000), abs=1e-3)
    cfg = replace(I.Config(), curve_betas=(-3, 2, 5), curve_t=3.0)
    curves = I.frontier_curves(cfg, u)
    assert list(curves) == ["standard", "BON-4", "WON-4"]
    assert list(curves["BON-4"]) == ["identity", "raw N(0,1)", "exp(3u)", "-exp(-3u)"]
    k, w = curves["WON-4"]["-exp(-3u)"]
    want = I.tilt_frontier(I.exp_won(3.0), torch.logspace(-3, 2, 5, dtype=torch.float64), 4, "won", u)
    assert (k, w) == (want[0].tolist(), want[1].tolist()) and len(k) == 5


def test_matched_kl_table_rows_and_the_identity_control():
    from dataclasses import replace

    cfg = replace(I.Config(), M=1000, settings=(("bon", 4),), budgets=(0.5,))
    row = I.matched_kl_table(cfg)["BON-4", 0.5]
    assert list(row) == ["identity", "log", "raw", "best exp(+tu)", "best -exp(-tu)"]
    assert row["identity"] == I.win_at_kl(I.identity, 4, "bon", 0.5, M=1000)
    assert row["best exp(+tu)"] >= row["identity"] + 0.05  # I3's gain
    ctl = I.matched_kl_table(cfg, "identity")["BON-4", 0.5]
    assert ctl["best exp(+tu)"] == ctl["best -exp(-tu)"] == ctl["identity"] == row["identity"]


def test_the_tiny_transformer_rewards_metrics_and_comparison():
    from dataclasses import replace

    cfg = replace(I.Config(), sft_steps=5, rl_steps=3, lm_ts=(5.0,))
    toy = I.lm_toy(cfg, 0)
    rewards = I.lm_rewards(toy, cfg)
    assert list(rewards) == ["raw RLHF", "CTRL identity", "CTRL exp(5u)"]
    torch.testing.assert_close(rewards["CTRL identity"], I.calibrate_exact(toy.ref_logp, toy.r))
    cal = rewards["CTRL identity"]
    torch.testing.assert_close(rewards["CTRL exp(5u)"], (torch.exp(5 * cal) - 1) / (math.exp(5) - 1))
    raw = I.lm_rewards(toy, cfg, "raw")["CTRL identity"]
    torch.testing.assert_close(raw, (toy.r - toy.r.min()) / (toy.r.max() - toy.r.min()))
    base = I.lm_metrics(toy.ref_logp.double(), toy, 4)  # π_ref against itself
    assert base["kl"] == pytest.approx(0.0, abs=1e-12) and base["bon"] == pytest.approx(0.5)
    assert base["std"] == pytest.approx(0.5)
    lm, betas = I.lm_compare(toy, cfg, quiet=True)
    assert list(lm) == list(rewards) == list(betas) and set(lm["raw RLHF"]) == {"closed", "trained"}
    for name in lm:
        assert lm[name]["closed"]["kl"] == pytest.approx(cfg.lm_kl, abs=1e-6)  # β matched on the closed form
    assert lm["CTRL exp(5u)"]["closed"]["bon"] > lm["CTRL identity"]["closed"]["bon"] > 0.5
