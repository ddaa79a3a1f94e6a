import math

import pytest
import torch

from lab.align import exact as X
from lab.align import expo as E
from lab.align import expo_lm as EL
from lab.align import tokens as T

PI_STAR = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
PI_REF = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)


def test_expo_loss_is_bt_on_the_policy_plus_weighted_kl():
    pi = torch.log(torch.tensor([[0.5, 0.2], [0.1, 0.4]], dtype=torch.float64))
    ref = torch.zeros(2, 2, dtype=torch.float64)  # ignored by the supervised term
    kl = torch.tensor([0.3, 0.0], dtype=torch.float64)
    want = torch.tensor([-math.log(0.5 / 0.7) + 2 * 0.3, -math.log(0.1 / 0.5)], dtype=torch.float64)
    torch.testing.assert_close(E.expo(pi, ref, lam=2.0, kl=kl), want)
    torch.testing.assert_close(E.expo(pi, ref + 5.0, lam=2.0, kl=kl), want)  # no reference ratio


def test_kl_exact_and_the_official_mean_reduction():
    lr, lp = PI_REF.log(), PI_STAR.log()
    want = float((PI_REF * (lr - lp)).sum())
    assert float(E.kl_exact(lr, lp)) == pytest.approx(want)
    assert float(E.kl_exact(lr, lp, scale="mean")) == pytest.approx(want / 3)
    ref = torch.nn.functional.kl_div(lp, lr, log_target=True, reduction="mean")  # the official call
    assert float(E.kl_exact(lr, lp, scale="mean")) == pytest.approx(float(ref))


def test_pair_table_weights():
    i, j, w = E.pair_table(PI_REF, PI_STAR)
    assert len(i) == 6 and float(w.sum()) == pytest.approx(1.0)
    k = [(a, b) for a, b in zip(i.tolist(), j.tolist())].index((0, 2))
    assert float(w[k]) == pytest.approx((0.6 / 0.7) / 3)  # uniform pair, label by BT(π*)
    _, _, wr = E.pair_table(PI_REF, PI_STAR, pairs="reference")
    Z = sum(PI_REF[a] * PI_REF[b] * PI_STAR[a] / (PI_STAR[a] + PI_STAR[b])
            for a in range(3) for b in range(3) if a != b)
    assert float(wr[k]) == pytest.approx(0.4 * 0.2 * 0.6 / 0.7 / float(Z))


@pytest.mark.parametrize("lam", [0.3, 1.0, 4.0])
def test_dpo_and_rlhf_population_minimizers_are_the_closed_form(lam):
    closed = E.dpo_minimizer(PI_REF, PI_STAR, lam)
    torch.testing.assert_close(E.solve("dpo", PI_REF, PI_STAR, lam), closed, atol=1e-6, rtol=0)
    logits = closed.log().clone().requires_grad_()  # the closed form is a stationary point of RLHF's objective
    E.population_loss("rlhf", logits, PI_REF, PI_STAR, lam).backward()
    assert logits.grad.abs().max() < 1e-10


def test_expo_population_minimizer_limits_and_preservation():
    torch.testing.assert_close(E.solve("expo", PI_REF, PI_STAR, 1e-6), PI_STAR, atol=1e-5, rtol=0)  # λ→0: π*
    torch.testing.assert_close(E.solve("expo", PI_REF, PI_STAR, 1e6), PI_REF, atol=1e-4, rtol=0)  # λ→∞: π_ref
    uniform = torch.zeros(len(PI_STAR))  # a start away from π*: at π_ref = π* EXPO's gradient is 0, so a solver
    for lam in (0.05, 1.0, 20.0):  # that never moved would pass; π_ref = π*: preserved for every λ
        torch.testing.assert_close(E.solve("expo", PI_STAR, PI_STAR, lam, start=uniform), PI_STAR, atol=1e-6, rtol=0)
    assert E.kl_divergence(PI_STAR, E.solve("dpo", PI_STAR, PI_STAR, 0.5)) > 0.1  # DPO moves the perfect prompt


def test_the_preservation_claim_fails_when_expo_is_swapped_for_dpo():
    """The notebook's claim C1, through the function its check reads (`expo.preservation_kl`), against the
    closed forms: with π_ref = π*, EXPO's minimizer is π* itself (both terms are minimal there), KL = 0; DPO's is
    π_ref·π*^{1/λ}/Z = π*^{1 + 1/λ}/Z, whose KL to π* is computed here by hand. C1 holds for EXPO, fails for DPO."""
    log_lams = (-3, -2, -1, 0, 1, 2, 3)  # the notebook's smoke grid
    star = [0.6, 0.3, 0.1]

    def dpo_by_hand(ll):
        w = [p ** (1 + math.exp(-ll)) for p in star]
        return sum(p * math.log(p / (wi / sum(w))) for p, wi in zip(star, w))

    got = {m: E.preservation_kl(m, log_lams) for m in ("expo", "dpo")}
    assert got["expo"].shape == (7,) and got["expo"].abs().max() < 1e-6
    torch.testing.assert_close(got["dpo"], torch.tensor([dpo_by_hand(ll) for ll in log_lams], dtype=torch.float64),
                               atol=1e-5, rtol=1e-5)
    assert float(got["dpo"][0]) == pytest.approx(7.26, abs=0.01)  # our reproduction's table at log λ = −3
    small = [k for k, ll in enumerate(log_lams) if ll <= 0]
    assert got["expo"].max() < 1e-3 and got["dpo"][small].min() > 0.1  # C1's two checks, with its thresholds
    assert not got["dpo"].max() < 1e-3  # C1's EXPO check fails on DPO's numbers
    dead = lambda method, logits, *a, **k: (logits * 0).sum()  # a loss with no gradient: its solver never moves
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(E, "population_loss", dead)
        assert E.preservation_kl("expo", (0.0,)).item() > 0.1  # so C1 fails it: it starts from the uniform policy
    # another context with π_ref = π*: the function solves the one it is given
    other = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    assert E.preservation_kl("expo", (0.0,), other).abs().max() < 1e-6
    assert E.preservation_kl("dpo", (0.0,), other) > 0.01


def test_our_reproduction_numbers_for_dpo_and_ipo():
    """Values of our own reproduction, not outputs of the official code: the table of population minimizers
    (L-BFGS on a re-implementation of the official losses, uniform pairs, KL(π*‖π) with sum reduction) made
    when this notebook was built. The official notebooks print no distances at all (their only printed
    numbers are pair counts, 213 and 141 + 136); they train by Adam on sampled pairs and plot figures. These
    pin the solver's output against that earlier, independent run."""
    assert E.kl_divergence(PI_STAR, E.solve("dpo", PI_STAR, PI_STAR, math.exp(-3))) == pytest.approx(7.26, abs=0.01)
    assert E.kl_divergence(PI_STAR, E.solve("dpo", PI_REF, PI_STAR, math.exp(-5))) == pytest.approx(56.6, abs=0.1)
    assert E.kl_divergence(PI_STAR, E.solve("ipo", PI_REF, PI_STAR, math.exp(-5))) == pytest.approx(11.3, abs=0.1)


def test_ipo_and_fdpo_move_the_preserved_context_too():
    """The preservation test for the other two baselines on the good context (π_ref = π* = [.6, .3, .1]),
    against independent references. IPO by hand: with uniform pairs and BT(π*) labels its population loss is a
    least-squares fit of h_i − h_j to (2 p_ij − 1)/(2λ) on the complete graph, solved by
    h_i = mean_j (2 p_ij − 1)/(2λ), π ∝ π_ref·exp(h). f-DPO has no closed form: its population loss, written
    out here as a loop over ordered pairs, is stationary at the solver's answer."""
    star, K = [0.6, 0.3, 0.1], 3
    for ll in (-3, -1, 0):
        lam = math.exp(ll)
        h = [sum(2 * star[i] / (star[i] + star[j]) - 1 for j in range(K)) / K / (2 * lam) for i in range(K)]
        w = [p * math.exp(x) for p, x in zip(star, h)]
        want = sum(p * math.log(p / (wi / sum(w))) for p, wi in zip(star, w))
        assert float(E.preservation_kl("ipo", (ll,))[0]) == pytest.approx(want, rel=1e-5, abs=1e-8)
    pi = E.solve("fdpo_js", PI_STAR, PI_STAR, math.exp(-3))
    logits = pi.log().clone().requires_grad_()
    lam, loss = math.exp(-3), 0.0
    p, r = logits.softmax(-1), PI_STAR
    for i in range(K):
        for j in range(K):
            if i != j:  # uniform pair, y_i ≻ y_j with probability π*_i / (π*_i + π*_j)
                g = [torch.log(2 * p[k]) - torch.log(p[k] + r[k]) for k in (i, j)]
                loss = loss - star[i] / (star[i] + star[j]) * torch.nn.functional.logsigmoid(lam * (g[0] - g[1]))
    loss.backward()
    assert logits.grad.abs().max() < 1e-9
    # our reproduction's values at log λ = −3 (not official outputs: see the test above)
    assert float(E.preservation_kl("ipo", (-3,))[0]) == pytest.approx(1.16, abs=0.01)
    assert float(E.preservation_kl("fdpo_js", (-3,))[0]) == pytest.approx(7.66, abs=0.01)


def test_enumerated_sequence_logprobs_are_a_distribution_and_match_a_loop():
    from lab.models import tiny_llama

    torch.manual_seed(0)
    seqs = X.all_sequences(3, 2)
    assert seqs.shape == (9, 2) and len({tuple(s) for s in seqs.tolist()}) == 9
    m = tiny_llama(vocab_size=5, d_model=16, n_layers=1, n_heads=2, max_len=4).eval()
    prompts = torch.tensor([3, 4])
    with torch.no_grad():
        logp = X.seq_logprobs(m, prompts, seqs, 3)  # (2, 9)
        torch.testing.assert_close(logp.exp().sum(-1), torch.ones(2))  # the responses exhaust the space
        x = torch.tensor([[4, 2, 0]])
        step = m(input_ids=x).logits[0, :, :3].log_softmax(-1)
        want = step[0, 2] + step[1, 0]
        torch.testing.assert_close(logp[1, seqs.tolist().index([2, 0])], want)


def test_tilt_hits_its_kl_and_exact_sft_fits():
    from lab.models import tiny_llama

    g = torch.Generator().manual_seed(0)
    base = torch.randn(27, dtype=torch.float64, generator=g).log_softmax(-1)
    q = EL.tilt(base, 0.7, g)
    assert float((q.exp() * (q - base)).sum()) == pytest.approx(0.7, abs=1e-6)
    torch.manual_seed(0)
    m = tiny_llama(vocab_size=5, d_model=16, n_layers=1, n_heads=2, max_len=4)
    seqs, prompts = X.all_sequences(3, 2), torch.tensor([3, 4])
    kls = X.fit_exact(m, prompts, seqs, torch.randn(2, 9).log_softmax(-1), 3, steps=60, lr=1e-2)
    assert kls[-1] < 0.5 * kls[0]


def test_the_dpo_control_trains_dpo_wherever_expo_was():
    """`Config.for_scale(scale, "dpo")` substitutes EXPO's loss and nothing else; C1 then fails on its numbers."""
    cfg, ctl = E.Config.for_scale("smoke"), E.Config.for_scale("smoke", "dpo")
    assert cfg.loss("expo") == "expo" and ctl.loss("expo") == "dpo" and ctl.loss("ipo") == "ipo"
    assert ctl.epochs == cfg.epochs and ctl.lm_lams == cfg.lm_lams and set(E.CONTROLS) == {"dpo", "no_kl"}
    assert E.Config.for_scale("full", "dpo").loss("expo") == "dpo"
    assert ctl.schedule("expo") == cfg.schedule("expo") == (cfg.lr_expo, cfg.epochs)  # EXPO's lr and epochs
    with pytest.raises(ValueError, match="unknown control"):
        E.Config.for_scale("smoke", "no_such_control")
    assert E.preservation_kl(ctl.loss("expo"), (-1.0,)).max() > 0.1  # the preserved context moves


def test_the_no_kl_control_drops_the_regularizer_and_breaks_the_large_lambda_limit():
    """The "no_kl" control trains EXPO's supervised term alone: the loss is −log σ(π_w − π_l) whatever λ, its population
    minimizer is π* at every λ, so the λ → ∞ claim (π_θ → π_ref, `ref_gap` → 0) fails with ref_gap = 1."""
    ctl = E.Config.for_scale("smoke", "no_kl")
    assert ctl.loss("expo") == "no_kl" and ctl.loss("dpo") == "dpo"
    pi = torch.log(torch.tensor([[0.5, 0.2], [0.1, 0.4]], dtype=torch.float64))
    want = torch.tensor([-math.log(0.5 / 0.7), -math.log(0.1 / 0.5)], dtype=torch.float64)
    torch.testing.assert_close(E.pair_loss("no_kl", pi, pi, 50.0), want)
    torch.testing.assert_close(E.pair_loss("expo", pi, pi, 2.0, torch.tensor([0.1, 0.2], dtype=torch.float64)),
                               want + torch.tensor([0.2, 0.4], dtype=torch.float64))
    far = E.solve("no_kl", PI_REF, PI_STAR, math.exp(5))
    torch.testing.assert_close(far, PI_STAR, atol=1e-5, rtol=0)
    assert E.ref_gap(PI_REF, PI_STAR, far) == pytest.approx(1.0, abs=1e-3)
    assert E.ref_gap(PI_REF, PI_STAR, E.solve("expo", PI_REF, PI_STAR, math.exp(5))) < 1e-3  # EXPO: at π_ref


def test_ref_gap_by_hand():
    kl = lambda p, q: sum(a * math.log(a / b) for a, b in zip(p, q))
    mid = torch.tensor([0.5, 0.35, 0.15], dtype=torch.float64)
    want = kl([0.4, 0.4, 0.2], [0.5, 0.35, 0.15]) / kl([0.4, 0.4, 0.2], [0.6, 0.3, 0.1])
    assert E.ref_gap(PI_REF, PI_STAR, mid) == pytest.approx(want, rel=1e-12)
    assert E.ref_gap(PI_REF, PI_STAR, PI_REF) == 0.0 and E.ref_gap(PI_REF, PI_STAR, PI_STAR) == pytest.approx(1.0)


def test_kl_divergence_is_kl_p_to_q():
    p, q = [0.6, 0.3, 0.1], [0.4, 0.4, 0.2]
    want = sum(a * math.log(a / b) for a, b in zip(p, q))  # by hand
    assert E.kl_divergence(PI_STAR, PI_REF) == pytest.approx(want, abs=1e-12)
    assert E.kl_divergence(PI_REF, PI_STAR) != pytest.approx(want, abs=1e-3)  # not symmetric: KL(p ‖ q) ≠ KL(q ‖ p)
    assert E.kl_divergence(PI_STAR, PI_STAR) == 0.0


def _naive_tabular(method, y_w, y_l, pi_ref, lam, epochs, lr, batch_size, record_every):
    """The official `train` written out: Adam over the pairs in order, grad-norm clip 10, a snapshot every
    `record_every` steps."""
    from lab.align import LOSSES

    logits = pi_ref.log().clone().requires_grad_()
    logp_ref = pi_ref.log()
    opt = torch.optim.Adam([logits], lr=lr)
    traj, step = [], 0
    for _ in range(epochs):
        for s in range(0, len(y_w), batch_size):
            w, l = y_w[s:s + batch_size], y_l[s:s + batch_size]
            logp = logits.log_softmax(-1)
            pi, ref = torch.stack([logp[w], logp[l]], 1), torch.stack([logp_ref[w], logp_ref[l]], 1)
            if method == "expo":
                loss = E.expo(pi, ref, lam=lam, kl=E.kl_exact(logp_ref, logp, scale="mean").expand(len(w)))
            else:
                loss = LOSSES[method](pi, ref, beta=lam)
            loss.mean().backward()
            torch.nn.utils.clip_grad_norm_([logits], 10.0)
            opt.step()
            opt.zero_grad()
            step += 1
            if step % record_every == 0:
                traj.append(logits.detach().softmax(-1))
    return logits.detach().softmax(-1), torch.stack(traj) if traj else pi_ref.new_zeros(0, len(pi_ref))


@pytest.mark.parametrize("method,record_every", [("expo", 5), ("dpo", 7), ("ipo", 4)])
def test_train_tabular_is_the_official_loop_bit_for_bit(method, record_every):
    """Through `lab.align.train.optimize`, the tabular trainer takes the same steps as the official loop
    (same batches in the same order, clip 10) and snapshots the same policies, including after the last step
    when the step count is a multiple of `record_every` (3 epochs × 7 batches = 21 steps)."""
    y_w, y_l = E.sample_pairs(PI_STAR, 200, torch.Generator().manual_seed(1))
    y_w, y_l = y_w[:130], y_l[:130]  # 7 batches of 20, the last one short
    arm = {"arm": (method, 0.1, 5e-2, 3)}
    got = E.train_tabular(arm, y_w, y_l, PI_REF, record_every=record_every, quiet=True)["arm"]
    want = _naive_tabular(method, y_w, y_l, PI_REF, 0.1, 3, 5e-2, 20, record_every)
    assert got[1].shape == (21 // record_every, 3)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_lockstep_arms_take_the_steps_each_would_take_alone():
    """Arms with different losses, λ, lr and epochs trained together equal the official loop run on each
    alone, bit for bit, including IPO at λ = 1e-3, whose gradient (∝ 1/λ) is clipped at every step."""
    y_w, y_l = E.sample_pairs(PI_STAR, 200, torch.Generator().manual_seed(2))
    arms = {"ipo": ("ipo", 1e-3, 1e-2, 2), "expo": ("expo", 0.5, 5e-2, 4), "fdpo": ("fdpo_js", 3.0, 2e-2, 5)}
    got = E.train_tabular(arms, y_w, y_l, PI_REF, record_every=6, quiet=True)
    for k, (method, lam, lr, epochs) in arms.items():
        want = _naive_tabular(method, y_w, y_l, PI_REF, lam, epochs, lr, 20, 6)
        assert all(torch.equal(a, b) for a, b in zip(got[k], want)), k


def test_sampled_runs_train_the_four_methods_at_both_lambdas_as_the_official_notebook():
    """The official interpolation notebook: DPO, IPO, f-DPO and EXPO, each at λ = 1e-5 and λ = 100, on the same
    pairs; lr 1e-3 except EXPO (5e-4); f-DPO three times the epochs."""
    from dataclasses import replace

    cfg = replace(E.Config.for_scale("smoke"), epochs=10, fdpo_epochs=30, n_pairs=60)
    assert E.Config.for_scale("smoke").sampled_lams == (1e-5, 100.0)
    full = E.Config.for_scale("full")
    assert (full.epochs, full.fdpo_epochs, full.lr_dpo, full.lr_expo) == (1000, 3000, 1e-3, 5e-4)  # official
    pi_ref, pi_star = E.Config.settings()["interpolation"]
    runs, n = E.sampled_runs(cfg, pi_ref, pi_star, 3)
    y_w, y_l = E.sample_pairs(pi_star, 60, torch.Generator().manual_seed(3))
    assert set(runs) == {(m, lam) for m in E.SAMPLED for lam in (1e-5, 100.0)} and n == len(y_w) < 60  # ties dropped
    for (m, lam), got in runs.items():
        lr, epochs = (5e-4, 10) if m == "expo" else (1e-3, 30 if m == "fdpo_js" else 10)
        want = _naive_tabular(m, y_w, y_l, pi_ref, lam, epochs, lr, 20, 50)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (m, lam)
    ctl = E.sampled_runs(replace(cfg, expo_loss="dpo"), pi_ref, pi_star, 3, methods=("expo",))[0]
    want = _naive_tabular("dpo", y_w, y_l, pi_ref, 100.0, 10, 5e-4, 20, 50)  # the control: DPO at EXPO's lr
    assert torch.equal(ctl["expo", 100.0][0], want[0])


def test_population_solutions_and_the_closed_form_gap():
    cfg = E.Config(interp_log_lams=(-1.0, 0.0), preserve_log_lams=(0.0,))
    sols = E.population_solutions(cfg)
    assert list(sols) == ["interpolation", "good", "bad"] and list(sols["good"]) == list(E.METHODS)
    assert sols["interpolation"]["expo"].shape == (2, 3) and sols["bad"]["dpo"].shape == (1, 3)
    torch.testing.assert_close(sols["good"]["expo"][0], PI_STAR, atol=1e-6, rtol=0)  # preserved
    gap = E.closed_form_gap(sols["interpolation"]["dpo"], PI_REF, PI_STAR, cfg.interp_log_lams)
    assert gap < 1e-5
    assert E.closed_form_gap(sols["interpolation"]["expo"], PI_REF, PI_STAR, cfg.interp_log_lams) > 0.05


def test_monotonicity_is_spearman_rank_correlation():
    from lab.core.stats import spearman

    lams = (-2.0, -1.0, 0.0, 1.0, 2.0)
    assert E.monotonicity(lams, torch.tensor([0.1, 0.2, 0.5, 0.9, 3.0])) == pytest.approx(1.0)
    assert E.monotonicity(lams, torch.tensor([3.0, 0.9, 0.5, 0.2, 0.1])) == pytest.approx(-1.0)
    d = torch.tensor([0.3, 0.1, 0.5, 0.2, 0.9], dtype=torch.float64)
    # 1 − 6 Σ d_i² / (n (n² − 1)) with rank differences (2, −1, 1, −2, 0) by hand: 1 − 6·10/120 = 0.5
    assert E.monotonicity(lams, d) == pytest.approx(0.5)
    assert E.monotonicity(lams, d) == pytest.approx(spearman(torch.tensor(lams), d)[0])


def test_a_flat_curve_is_not_monotone():
    """A distance that does not depend on λ (what the no_kl control produces) must not read as "grows with λ".
    Ranked by sort order without averaging ties (the earlier rule) its Spearman is 1 and C2 passed."""
    lams = (-2.0, -1.0, 0.0, 1.0, 2.0)
    flat = torch.full((5,), 0.0877, dtype=torch.float64)
    old = [x.argsort().argsort().double() for x in (torch.tensor(lams), flat)]  # the earlier ranking
    assert torch.corrcoef(torch.stack(old))[0, 1] >= 0.999  # the old check passed on a flat curve
    assert not E.monotonicity(lams, flat) >= 0.999  # nan: fails the check


def test_dip_reads_a_u_shape_and_not_a_falling_curve():
    """DPO's non-monotonicity on the bad prompt. The earlier record, KL(λ=0.1) − KL(λ=1) > 0, passes for a curve
    that only falls (seed 0's DPO curve, 14.29, 1.30, 0.84); `dip` needs the interior minimum below both ends."""
    falling = torch.tensor([14.29, 1.30, 0.84])
    u_shape = torch.tensor([3.70, 0.90, 3.52])
    assert float(falling[0] - falling[1]) > 0  # the old check: passes on a monotone curve
    assert E.dip(falling) < 0 and E.dip(falling) == pytest.approx(0.84 - 1.30)
    assert E.dip(u_shape) == pytest.approx(3.52 - 0.90)  # min(KL(0.1), KL(10)) − KL(1), by hand
    assert E.dip(torch.tensor([0.1, 0.5, 0.9, 1.2])) < 0  # rising: no dip either
    assert E.dip(torch.tensor([2.0, 0.3, 0.1, 0.5])) == pytest.approx(0.4)  # longer grid: min(2.0, 0.5) − 0.1


def test_lm_sweep_trains_a_fresh_copy_per_method_and_lambda():
    from dataclasses import replace

    cfg = replace(E.Config.for_scale("smoke"), sft_steps=10, lm_steps=3, lm_batch=8, lm_lams=(0.1, 1.0))
    toy = EL.lm_toy(cfg, 0)
    before = [p.clone() for p in toy.reference.parameters()]
    got, policies = EL.lm_sweep(toy, cfg, 0)
    assert list(got) == list(policies) == [("dpo", 0.1), ("dpo", 1.0), ("expo", 0.1), ("expo", 1.0)]
    assert all(torch.equal(a, b) for a, b in zip(before, toy.reference.parameters()))  # π_ref untouched
    import copy

    logp = EL.train_lm("expo", copy.deepcopy(toy.reference), toy.prompts, toy.seqs, toy.ref_logp, toy.star_logp, 1.0,
                      V=cfg.V, steps=3, lr=cfg.lm_lr, batch=8, generator=torch.Generator().manual_seed(1), quiet=True)
    want = [sum(float(p.exp()) * (float(p) - float(q)) for p, q in zip(toy.star_logp[c], logp[c])) for c in range(2)]
    torch.testing.assert_close(got["expo", 1.0].double(), torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=0)
    with torch.no_grad():  # the returned policy is the one measured
        torch.testing.assert_close(X.seq_logprobs(policies["expo", 1.0], toy.prompts, toy.seqs, cfg.V), logp)


# ------------------------------------------------ EXPO's regularizer beyond enumeration (LM scale)

def _small_lms(V=4, L=2, seed=0):
    """A tiny reference LM and a perturbed policy over a 4-token vocabulary (prompt token 3), with every
    length-2 response over the full vocabulary enumerated (16) and scored by a naive loop."""
    import copy

    from lab.models import tiny_llama

    torch.manual_seed(seed)
    ref = tiny_llama(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=L + 1).eval()
    pol = copy.deepcopy(ref)
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(0.3 * torch.randn_like(p))
    seqs = X.all_sequences(V, L)  # (16, 2)

    def seq_logp(model):  # naive: one response at a time, full-vocabulary softmax
        out = []
        for y in seqs.tolist():
            logp = model(input_ids=torch.tensor([[3, *y]])).logits[0].log_softmax(-1)
            out.append(sum(logp[t, y[t]] for t in range(L)))
        return torch.stack(out)

    with torch.no_grad():
        return ref, pol, seqs, seq_logp(ref), seq_logp(pol)


def test_token_kl_along_reference_samples_is_the_sequence_kl_and_along_chosen_responses_is_not():
    """Chain rule, checked by exact enumeration: Σ_y π_ref(y) Σ_t KL(π_ref(·|y_<t) ‖ π_θ(·|y_<t)) equals
    KL(π_ref ‖ π_θ) over whole responses. The same sum weighted by another law of responses (a preference
    dataset's chosen ones, what `lab.align.train.chosen_token_kl` sums along) does not, and the per-response
    sums are exactly `chosen_token_kl`'s."""
    from lab.align.train import chosen_token_kl, token_logprobs

    ref, pol, seqs, lr, lp = _small_lms()
    exact = float((lr.exp() * (lr - lp)).sum())
    x = torch.full((len(seqs), 1), 3)
    with torch.no_grad():
        tk = T.token_kl(T.token_dists(ref, x, seqs), T.token_dists(pol, x, seqs))  # (16,)
        ids = torch.cat([x, seqs], 1)[:, None].expand(-1, 2, -1)  # (16, 2, 3): the response as "chosen"
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "response_mask": torch.tensor([0, 1, 1]).expand_as(ids)}
        dr = token_logprobs(ref, ids.reshape(-1, 3), batch["attention_mask"].reshape(-1, 3))[1]
        dp = token_logprobs(pol, ids.reshape(-1, 3), batch["attention_mask"].reshape(-1, 3))[1]
        torch.testing.assert_close(chosen_token_kl(dr, dp, batch), tk, atol=1e-5, rtol=1e-5)
    assert exact > 0.05
    assert float((lr.exp() * tk).sum()) == pytest.approx(exact, rel=1e-4)
    star = (3.0 * (seqs[:, 0] == 1)).float().log_softmax(-1)  # a π* ≠ π_ref labelling the pairs (favours y_1 = 1)
    chosen = 2 * lr.exp() * (torch.sigmoid(star[:, None] - star[None, :]) * lr.exp()[None, :]).sum(-1)
    assert float(chosen.sum()) == pytest.approx(1.0, abs=1e-5)  # a law of the chosen response
    assert abs(float((chosen * tk).sum()) - exact) > 0.05 * exact  # summed along chosen responses: biased (−5.7 %)


def test_reference_kl_samples_from_the_reference_and_converges_to_the_exact_kl():
    ref, pol, seqs, lr, lp = _small_lms()
    exact = float((lr.exp() * (lr - lp)).sum())
    g = torch.Generator().manual_seed(0)
    y = T.sample_responses(ref, torch.full((20000, 1), 3), 2, g)  # (20000, 2)
    freq = torch.bincount(y[:, 0] * 4 + y[:, 1], minlength=16).double() / len(y)
    assert (freq - lr.exp().double()).abs().max() < 0.015  # draws follow π_ref
    prompts = torch.tensor([[3], [3]])
    est = E.reference_kl(ref, pol, prompts, n=4000, length=2, generator=g)
    assert est.shape == (2,) and est.requires_grad
    torch.testing.assert_close(est.detach().double(), torch.full((2,), exact, dtype=torch.float64), atol=0.02 * exact,
                               rtol=0.05)


def test_token_kl_expectations_on_the_toy():
    """The notebook's measurement: exact KL(π_ref‖π_θ) by sequence enumeration equals the π_ref-weighted token KL;
    the chosen-response weighting is a different number."""
    from dataclasses import replace

    cfg = replace(E.Config.for_scale("smoke"), V=3, L=2, sft_steps=20)
    toy = EL.lm_toy(cfg, 0)
    import copy

    pol = copy.deepcopy(toy.reference)
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(0.2 * torch.randn_like(p))
        logp = X.seq_logprobs(pol, toy.prompts, toy.seqs, cfg.V)
    got = EL.token_kl_expectations(toy, pol, cfg.V)
    exact = (toy.ref_logp.exp() * (toy.ref_logp - logp)).sum(-1)
    torch.testing.assert_close(got["exact KL(π_ref‖π_θ)"], exact)
    torch.testing.assert_close(got["token KL along π_ref samples"], exact, atol=1e-5, rtol=1e-4)
    assert (got["token KL along chosen responses"] - exact).abs().max() > 1e-3


def test_the_regression_objective_is_not_built_and_says_so():
    with pytest.raises(NotImplementedError, match="compositional"):
        E.expo_regression()
