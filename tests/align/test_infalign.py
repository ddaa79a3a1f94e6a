import math

import pytest
import torch

from lab.align import exact as X
from lab.align import infalign as I
from lab.align import infalign_scales as S

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
        torch.testing.assert_close(I.transform(kind, 5.0, "global_calibration")(u), I.transform(kind, 5.0)(u))
    # `swapped_sign`: each procedure gets the other's exponential, still increasing in u
    torch.testing.assert_close(I.transform("bon", 5.0, "swapped_sign")(u), -torch.exp(-5.0 * u))
    torch.testing.assert_close(I.transform("won", 5.0, "swapped_sign")(u), torch.exp(5.0 * u))
    assert (I.transform("bon", 5.0, "swapped_sign")(u).diff() > 0).all()
    # under `identity` the best "exponential" is the identity itself: the BoN gain (I3) vanishes
    assert I.best_exp(4, "bon", 0.5, control="identity")[1] == pytest.approx(I.win_at_kl(I.identity, 4, "bon", 0.5))
    assert I.best_exp(4, "bon", 0.5)[1] > I.best_exp(4, "bon", 0.5, control="identity")[1] + 0.05
    # under `swapped_sign` the BoN column holds the best −exp(−tu) under the BoN win rate: below the identity
    swapped = I.best_exp(4, "bon", 0.5, control="swapped_sign")[1]
    assert swapped == pytest.approx(max(I.win_at_kl(I.exp_won(t), 4, "bon", 0.5) for t in I.TS), abs=1e-12)
    assert swapped < I.win_at_kl(I.identity, 4, "bon", 0.5)
    # calibration: per-prompt quantiles (scale-free) vs the `global_calibration` control's pooled quantile
    ref = torch.full((2, 4), 0.25, dtype=torch.float64).log()
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    cal = S.calibration(ref, r)
    torch.testing.assert_close(cal[0], cal[1])
    for control in ("identity", "swapped_sign"):  # the transform controls leave calibration alone
        torch.testing.assert_close(S.calibration(ref, r, control), cal)
    pooled = S.calibration(ref, r, "global_calibration")  # the 8 rewards ranked together: the small prompt sits low
    torch.testing.assert_close(pooled, torch.tensor([[0.5625, 0.6875, 0.8125, 0.9375],
                                                     [0.0625, 0.1875, 0.3125, 0.4375]], dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown control"):
        I.transform("bon", 1.0, "nope")


def test_global_calibration_against_a_naive_loop_and_monte_carlo():
    """`calibrate_global` (sorted, cumulative) against the definition, pair by pair, with ties and unequal π_ref;
    and against sampling from the pooled π_ref (a uniform mixture over prompts)."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 7, generator=g, dtype=torch.float64).log_softmax(-1)
    r = torch.randint(0, 5, (3, 7), generator=g).double() * torch.tensor([[1.0], [0.5], [2.0]])  # ties within/across
    got = S.calibrate_global(ref, r)
    p = ref.exp() / 3
    for c in range(3):
        for y in range(7):
            want = sum(float(p[d, k]) * (float(r[d, k] < r[c, y]) + 0.5 * float(r[d, k] == r[c, y]))
                       for d in range(3) for k in range(7))
            assert float(got[c, y]) == pytest.approx(want, abs=1e-12)
    n = 400_000
    prompt = torch.randint(0, 3, (n,), generator=g)
    resp = torch.multinomial(ref.exp(), n, replacement=True, generator=g)[prompt, torch.arange(n)]
    draws = r[prompt, resp]
    x = r.reshape(-1, 1)
    mc = (draws[None] < x).double().mean(-1) + 0.5 * (draws[None] == x).double().mean(-1)
    torch.testing.assert_close(got.reshape(-1), mc, atol=4e-3, rtol=0)


def test_zscore_and_exp_z_against_numpy():
    import numpy as np

    g = torch.Generator().manual_seed(1)
    ref = torch.randn(2, 9, generator=g, dtype=torch.float64).log_softmax(-1)
    r = torch.randn(2, 9, generator=g, dtype=torch.float64) * torch.tensor([[3.0], [0.01]]) + 5
    z = S.zscore(ref, r)
    for c in range(2):
        p, x = ref[c].exp().numpy(), r[c].numpy()
        mu = np.average(x, weights=p)
        want = (x - mu) / math.sqrt(np.average((x - mu) ** 2, weights=p))
        np.testing.assert_allclose(z[c].numpy(), want, atol=1e-10)
    torch.testing.assert_close(S.zscore(ref, r * 7 - 2), z)  # a per-prompt affine map is removed
    torch.testing.assert_close(S.exp_z(z, 2.0), torch.exp(2.0 * z) / torch.exp(2.0 * z).max())
    assert S.best_baseline({"raw RLHF": {"std": 0.6, "bon": 0.6}, "z-scored": {"std": 0.7, "bon": 0.7},
                            "z-scored exp(tz)": {"std": 0.9, "bon": 0.8}}, "std") == 0.7  # exp(tz) tuned for BoN
    assert S.best_baseline({"raw RLHF": {"bon": 0.6}, "z-scored": {"bon": 0.7}, "z-scored exp(tz)": {"bon": 0.8}},
                           "bon") == 0.8


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

    cfg = replace(I.Config(), sft_steps=5, rl_steps=3, lm_ts=(5.0,), z_ts=(0.5, 2.0))
    toy = S.lm_toy(cfg, 0)
    rewards = S.lm_rewards(toy, cfg)
    assert list(rewards) == ["raw RLHF", "z-scored", "z-scored exp(tz)", "CTRL identity", "CTRL exp(5u)"]
    torch.testing.assert_close(rewards["CTRL identity"], X.calibrate_exact(toy.ref_logp, toy.r))
    cal = rewards["CTRL identity"]
    torch.testing.assert_close(rewards["CTRL exp(5u)"], (torch.exp(5 * cal) - 1) / (math.exp(5) - 1))
    # the baseline's t: the best of `z_ts` by the closed form's BoN-4 win rate, found by brute force here
    z = S.zscore(toy.ref_logp, toy.r)
    bon = {}
    for t in cfg.z_ts:
        R = S.exp_z(z, t)
        logp = X.tilt_logp(toy.ref_logp, R, X.beta_for_kl(toy.ref_logp, R, 0.5))
        bon[t] = float(X.win_rate(logp, toy.ref_logp, toy.r, 4).mean())
    t_best = max(bon, key=bon.get)
    assert S.best_t(toy.ref_logp, z, toy.r, cfg) == t_best
    torch.testing.assert_close(rewards["z-scored exp(tz)"], S.exp_z(z, t_best))
    # each control changes only what it names: the baselines never move; global_calibration only the calibration,
    # swapped_sign and identity only the transform
    glob = S.lm_rewards(toy, cfg, "global_calibration")
    swap = S.lm_rewards(toy, cfg, "swapped_sign")
    for got in (glob, swap, S.lm_rewards(toy, cfg, "identity")):
        for name in ("raw RLHF", "z-scored", "z-scored exp(tz)"):
            torch.testing.assert_close(got[name], rewards[name])
    g = S.calibrate_global(toy.ref_logp, toy.r)
    torch.testing.assert_close(glob["CTRL identity"], g)
    torch.testing.assert_close(glob["CTRL exp(5u)"], (torch.exp(5 * g) - 1) / (math.exp(5) - 1))
    torch.testing.assert_close(swap["CTRL identity"], cal)
    torch.testing.assert_close(swap["CTRL exp(5u)"], (1 - torch.exp(-5 * cal)) / (1 - math.exp(-5)))
    base = S.lm_metrics(toy.ref_logp.double(), toy, 4)  # π_ref against itself
    assert base["kl"] == pytest.approx(0.0, abs=1e-12) and base["bon"] == pytest.approx(0.5)
    assert base["std"] == pytest.approx(0.5)
    lm, betas = S.lm_compare(toy, cfg, quiet=True)
    assert list(lm) == list(rewards) == list(betas) and set(lm["raw RLHF"]) == {"closed", "trained"}
    assert lm["z-scored exp(tz)"]["t"] == t_best
    for name in betas:
        assert lm[name]["closed"]["kl"] == pytest.approx(cfg.lm_kl, abs=1e-6)  # β matched on the closed form
    assert lm["CTRL exp(5u)"]["closed"]["bon"] > lm["CTRL identity"]["closed"]["bon"] > 0.5


def _objective(q, N, kind, beta, sub=16):
    """W_T(q) − β·KL(q ‖ U[0, 1]) for the piecewise-constant density q on M equal cells, computed independently
    of the module: the win rate from the density of the best (worst) of N draws, N·F^{N−1}·q (N·(1−F)^{N−1}·q),
    against the base's P(max < x) = x^N (P(min < x) = 1 − (1 − x)^N), with F piecewise linear on a fine grid."""
    M = q.shape[-1]
    cell = torch.arange(M * sub) // sub
    x = (torch.arange(M * sub, dtype=torch.float64) + 0.5) / (M * sub)
    qx = q[cell]
    Fx = torch.cat([q.new_zeros(1), q.cumsum(0) / M])[cell] + qx * (x - cell / M)
    if kind == "bon":
        W = (x ** N * N * Fx ** (N - 1) * qx).mean()
    else:
        W = ((1 - (1 - x) ** N) * N * (1 - Fx) ** (N - 1) * qx).mean()
    return W - beta * (q * q.log()).mean()


def _direct_optimum(M, N, kind, beta):
    """The independent solver: maximize `_objective` over q = M·softmax(θ) with L-BFGS (autograd)."""
    th = torch.zeros(M, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([th], lr=1, max_iter=400, tolerance_grad=1e-12, tolerance_change=1e-15, history_size=50,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = -_objective(M * th.softmax(0), N, kind, beta)
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    return (M * th.softmax(0)).detach()


@pytest.mark.parametrize("N,kind,beta,M,tol_q,tol_w", [(4, "bon", 0.05, 400, 0.03, 1e-3),
                                                      (4, "won", 0.05, 200, 5e-3, 1e-4),
                                                      (8, "bon", 0.1, 400, 0.06, 2e-3)])
def test_the_fixed_point_for_n_above_1_is_the_maximizer_of_the_inference_time_objective(N, kind, beta, M, tol_q, tol_w):
    """The damped fixed point of R[q] (the derived functional derivative) against a direct maximization of
    W_T − β·KL by L-BFGS on the same cells (an independent discretization: the two agree as M grows). Before
    the derivative was taken from the cell's midpoint (half the own cell in ∫_w^1), the fixed point sat half a
    cell off: densities 9 %, 1.7 % and 12.5 % apart and win rates 0.0021, 0.0004 and 0.0042 (these three cases)."""
    q_fp, q_direct = I.fixed_point(beta, N, kind, M=M, iters=2000), _direct_optimum(M, N, kind, beta)
    assert float(_objective(q_fp, N, kind, beta)) == pytest.approx(float(_objective(q_direct, N, kind, beta)), abs=3e-5)
    assert I.win_rate(q_fp, N, kind) == pytest.approx(I.win_rate(q_direct, N, kind), abs=tol_w)
    assert float((q_fp - q_direct).abs().max() / q_direct.max()) < tol_q
    # brute force over a family: no exponential transform at the same β does better on the objective
    u = I.grid(M)
    family = [I.exp_bon(t) for t in (0.5, 1, 2, 5, 10, 20)] + [I.exp_won(t) for t in (0.5, 1, 2, 5, 10, 20)]
    best_family = max(float(_objective(I.density(lambda v, f=f, c=c: c * f(v), beta, u), N, kind, beta))
                      for f in family for c in (0.01, 0.03, 0.1, 0.3, 1.0))
    assert float(_objective(q_fp, N, kind, beta)) >= best_family - 1e-6


def test_the_fixed_point_iterates_a_batch_of_betas_row_by_row():
    betas = torch.tensor([0.05, 0.5], dtype=torch.float64)
    qs = I.fixed_point(betas, 4, "won", M=300, iters=200)
    assert qs.shape == (2, 300)
    for b, q in zip(betas, qs):
        torch.testing.assert_close(q, I.fixed_point(float(b), 4, "won", M=300, iters=200), rtol=1e-12, atol=1e-12)


def test_the_bon_rows_score_the_won_signed_transform_with_the_bon_win_rate():
    """Every column of a row is measured with the row's own T: the BoN-4 row's "best −exp(−tu)" is the best
    −exp(−tu) tilt scored by the BoN-4 win rate (it once took `best_exp(N, "won", ...)`, the WoN-4 score)."""
    from dataclasses import replace

    cfg = replace(I.Config(), M=1000, settings=(("bon", 4), ("won", 4)), budgets=(0.5,))
    table = I.matched_kl_table(cfg)
    bon_scored = max(I.win_at_kl(I.exp_won(t), 4, "bon", 0.5, M=1000) for t in I.TS)
    won_scored = max(I.win_at_kl(I.exp_won(t), 4, "won", 0.5, M=1000) for t in I.TS)
    assert table["BON-4", 0.5]["best -exp(-tu)"] == pytest.approx(bon_scored, abs=1e-12)
    assert table["BON-4", 0.5]["best -exp(-tu)"] < won_scored - 0.1  # the two scores are far apart
    assert table["WON-4", 0.5]["best -exp(-tu)"] == pytest.approx(won_scored, abs=1e-12)
    assert table["WON-4", 0.5]["best exp(+tu)"] == pytest.approx(
        max(I.win_at_kl(I.exp_bon(t), 4, "won", 0.5, M=1000) for t in I.TS), abs=1e-12)


def test_heterogeneous_scales_against_the_gaussian_tilt_closed_form():
    """Raw RLHF on r = σ·z, z ~ N(0, 1), tilted by e^{r/β}, is N(σ/β, 1): KL = s²/2 and standard win rate
    Φ_N(s/√2), s = σ/β (by hand). Calibration makes every prompt the same tilt, at the shared KL budget."""
    from dataclasses import replace

    cfg = replace(I.Config(), M=20000)
    got = S.heterogeneous(cfg)
    raw = got["raw RLHF"]
    s = torch.tensor(cfg.het_sigmas, dtype=torch.float64) / raw["beta"]
    # the grid stops at z = Φ_N^{-1}(1 − 1/2M) ≈ 3.9: the σ = 1 tilt (mean 1.7) loses ~1 % of its KL in the tail
    torch.testing.assert_close(torch.tensor(raw["kl"], dtype=torch.float64), s ** 2 / 2, atol=0, rtol=1.5e-2)
    assert raw["std"] == pytest.approx(float(torch.special.ndtr(s / math.sqrt(2)).mean()), abs=5e-4)
    assert sum(raw["kl"]) / len(raw["kl"]) == pytest.approx(cfg.lm_kl, abs=1e-6)
    cal = got["CTRL identity"]
    assert cal["kl"] == pytest.approx([cfg.lm_kl] * len(cfg.het_sigmas), abs=1e-6)
    assert cal["std"] == pytest.approx(I.win_at_kl(I.identity, 1, "bon", cfg.lm_kl, M=cfg.M), abs=1e-6)
    assert list(got) == ["raw RLHF", "z-scored", "z-scored exp(tz)", "CTRL identity", "CTRL exp(10u)"]
    # z-scoring makes every prompt the N(0, 1) reward: its standard win rate is the single-prompt Gaussian tilt's
    zs = got["z-scored"]
    assert zs["kl"] == pytest.approx([cfg.lm_kl] * len(cfg.het_sigmas), abs=1e-3)
    assert zs["std"] == pytest.approx(I.win_at_kl(I.raw_gaussian, 1, "bon", cfg.lm_kl, M=cfg.M), abs=1e-3)
    small = replace(cfg, M=1000)  # the baseline's t is the best of `z_ts` for BoN-4: brute force
    assert S.heterogeneous(small)["z-scored exp(tz)"]["bon"] == max(
        S.heterogeneous(replace(small, z_ts=(t,)))["z-scored exp(tz)"]["bon"] for t in cfg.z_ts)
    # the controls: `global_calibration` ranks prompt i's reward σ_i·z under the pooled CDF mean_j Φ_N(σ_i·z/σ_j)
    # (closed form) and leaves the baselines alone; `identity` leaves the calibrated identity for the exponential
    glob = S.heterogeneous(cfg, "global_calibration")
    for name in ("raw RLHF", "z-scored", "z-scored exp(tz)"):
        assert glob[name] == got[name]
    sig = torch.tensor(cfg.het_sigmas, dtype=torch.float64)
    zg = I.raw_gaussian(I.grid(cfg.M))
    pooled = torch.special.ndtr(sig[:, None, None] * zg / sig[None, :, None]).mean(1)  # (P, M)
    beta = S.shared_beta(pooled, I.grid(cfg.M), cfg.lm_kl)
    want = sum(I.win_rate(q) for q in I.density(pooled, beta, I.grid(cfg.M))) / len(sig)
    assert glob["CTRL identity"]["std"] == pytest.approx(want, abs=1e-4)
    assert glob["CTRL identity"]["std"] < got["z-scored"]["std"] < cal["std"]  # I2 broken by its mechanism
    ident = S.heterogeneous(cfg, "identity")
    assert ident["CTRL exp(10u)"]["bon"] == pytest.approx(cal["bon"], abs=1e-9)


def test_sampled_calibration_ranks_among_k_base_draws_and_converges_to_the_exact_one():
    from dataclasses import replace

    cfg = replace(I.Config(), sft_steps=20, lm_ts=(10.0,), cal_Ks=(4, 4096), cal_draws=2)
    toy = S.lm_toy(cfg, 0)
    g = torch.Generator().manual_seed(3)
    got = S.sampled_calibration(toy, 5, g)
    g = torch.Generator().manual_seed(3)
    idx = torch.multinomial(toy.ref_logp.double().exp(), 5, replacement=True, generator=g)
    for c in range(len(toy.prompts)):  # a naive loop: fraction of the 5 draws below, ties ½
        base = [float(toy.r[c, i]) for i in idx[c]]
        for y in (0, 17, 100):
            r = float(toy.r[c, y])
            assert float(got[c, y]) == pytest.approx(sum((b < r) + 0.5 * (b == r) for b in base) / 5)
    sweep = S.calibration_sweep(toy, cfg, 0)
    assert list(sweep) == ["K=4", "K=4096", "exact"]
    assert sweep["exact"]["err"] == 0.0 and sweep["exact"]["sat"] == 0.0
    assert sweep["K=4096"]["err"] < 0.02 < sweep["K=4"]["err"]
    assert sweep["K=4"]["sat_ref"] == pytest.approx(0.2, abs=0.1)  # P(beat all 4 draws) ≈ 1/5
    assert sweep["K=4"]["sat"] > sweep["K=4096"]["sat"]  # saturation fades as K grows
    assert sweep["K=4096"]["bon"] == pytest.approx(sweep["exact"]["bon"], abs=5e-3)
    lm, _ = S.lm_compare(toy, replace(cfg, rl_steps=1), quiet=True)
    assert sweep["exact"]["bon"] == pytest.approx(lm["CTRL exp(10u)"]["closed"]["bon"], abs=1e-9)
    ident = S.calibration_sweep(toy, cfg, 0, "identity")
    assert all(v["bon"] == v["bon_identity"] for v in ident.values())
    # `global_calibration`: every prompt ranked among the C·K draws of all prompts pooled (same draws, same seed)
    g = torch.Generator().manual_seed(3)
    pooled = S.sampled_calibration(toy, 5, g, "global_calibration")
    g = torch.Generator().manual_seed(3)
    idx = torch.multinomial(toy.ref_logp.double().exp(), 5, replacement=True, generator=g)
    base = [float(toy.r[c, i]) for c in range(len(toy.prompts)) for i in idx[c]]
    for c, y in ((0, 3), (2, 50), (3, 200)):
        r = float(toy.r[c, y])
        assert float(pooled[c, y]) == pytest.approx(sum((b < r) + 0.5 * (b == r) for b in base) / len(base))
