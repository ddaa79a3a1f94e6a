import math

import pytest
import torch

from lab.align import exact as X
from lab.align import expo as E

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
    for lam in (0.05, 1.0, 20.0):  # π_ref = π*: preserved for every λ
        torch.testing.assert_close(E.solve("expo", PI_STAR, PI_STAR, lam), PI_STAR, atol=1e-6, rtol=0)
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
    assert float(got["dpo"][0]) == pytest.approx(7.26, abs=0.01)  # the official table at log λ = −3
    small = [k for k, ll in enumerate(log_lams) if ll <= 0]
    assert got["expo"].max() < 1e-3 and got["dpo"][small].min() > 0.1  # C1's two checks, with its thresholds
    assert not got["dpo"].max() < 1e-3  # C1's EXPO check fails on DPO's numbers
    # another context with π_ref = π*: the function solves the one it is given
    other = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    assert E.preservation_kl("expo", (0.0,), other).abs().max() < 1e-6
    assert E.preservation_kl("dpo", (0.0,), other) > 0.01


def test_official_numbers_for_dpo_and_ipo():
    """DPO and IPO reproduce the reference tables (uniform pairs, KL(π*‖π) with sum reduction)."""
    assert E.kl_divergence(PI_STAR, E.solve("dpo", PI_STAR, PI_STAR, math.exp(-3))) == pytest.approx(7.26, abs=0.01)
    assert E.kl_divergence(PI_STAR, E.solve("dpo", PI_REF, PI_STAR, math.exp(-5))) == pytest.approx(56.6, abs=0.1)
    assert E.kl_divergence(PI_STAR, E.solve("ipo", PI_REF, PI_STAR, math.exp(-5))) == pytest.approx(11.3, abs=0.1)


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
    q = E.tilt(base, 0.7, g)
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
    assert ctl.epochs == cfg.epochs and ctl.lm_lams == cfg.lm_lams and set(E.CONTROLS) == {"dpo"}
    assert E.Config.for_scale("full", "dpo").loss("expo") == "dpo"
    with pytest.raises(ValueError, match="unknown control"):
        E.Config.for_scale("smoke", "no_such_control")
    assert E.preservation_kl(ctl.loss("expo"), (-1.0,)).max() > 0.1  # the preserved context moves


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
    return logits.detach().softmax(-1), torch.stack(traj)


@pytest.mark.parametrize("method,record_every", [("expo", 5), ("dpo", 7), ("ipo", 4)])
def test_train_tabular_is_the_official_loop_bit_for_bit(method, record_every):
    """Through `lab.align.train.optimize`, the tabular trainer takes the same steps as the official loop
    (same batches in the same order, clip 10) and snapshots the same policies, including after the last step
    when the step count is a multiple of `record_every` (3 epochs × 7 batches = 21 steps)."""
    y_w, y_l = E.sample_pairs(PI_STAR, 200, torch.Generator().manual_seed(1))
    y_w, y_l = y_w[:130], y_l[:130]  # 7 batches of 20, the last one short
    got = E.train_tabular(method, y_w, y_l, PI_REF, 0.1, epochs=3, lr=5e-2, record_every=record_every, quiet=True)
    want = _naive_tabular(method, y_w, y_l, PI_REF, 0.1, 3, 5e-2, 20, record_every)
    assert got[1].shape == (21 // record_every, 3)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_sampled_runs_train_each_method_on_the_same_pairs():
    from dataclasses import replace

    cfg = replace(E.Config.for_scale("smoke"), epochs=30, n_pairs=60)  # 2 batches a epoch: snapshots at 50 steps
    pi_ref, pi_star = E.Config.settings()["interpolation"]
    runs, n = E.sampled_runs(cfg, pi_ref, pi_star, 3)
    y_w, y_l = E.sample_pairs(pi_star, 60, torch.Generator().manual_seed(3))
    assert list(runs) == ["dpo", "expo"] and n == len(y_w) < 60  # ties dropped
    for m, lr in (("dpo", cfg.lr_dpo), ("expo", cfg.lr_expo)):
        want = E.train_tabular(m, y_w, y_l, pi_ref, cfg.sampled_lam, epochs=30, lr=lr, quiet=True)
        assert all(torch.equal(a, b) for a, b in zip(runs[m], want))
    ctl = E.sampled_runs(replace(cfg, expo_loss="dpo"), pi_ref, pi_star, 3)[0]  # the control trains DPO at EXPO's lr
    want = E.train_tabular("dpo", y_w, y_l, pi_ref, cfg.sampled_lam, epochs=30, lr=cfg.lr_expo, quiet=True)
    assert torch.equal(ctl["expo"][0], want[0])


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
    assert float(E.monotonicity(lams, torch.tensor([0.1, 0.2, 0.5, 0.9, 3.0]))) == pytest.approx(1.0)
    assert float(E.monotonicity(lams, torch.tensor([3.0, 0.9, 0.5, 0.2, 0.1]))) == pytest.approx(-1.0)
    d = torch.tensor([0.3, 0.1, 0.5, 0.2, 0.9], dtype=torch.float64)
    # 1 − 6 Σ d_i² / (n (n² − 1)) with rank differences (2, −1, 1, −2, 0) by hand: 1 − 6·10/120 = 0.5
    assert float(E.monotonicity(lams, d)) == pytest.approx(0.5)
    assert float(E.monotonicity(lams, d)) == pytest.approx(spearman(torch.tensor(lams), d)[0])


def test_lm_sweep_trains_a_fresh_copy_per_method_and_lambda():
    from dataclasses import replace

    cfg = replace(E.Config.for_scale("smoke"), sft_steps=10, lm_steps=3, lm_batch=8, lm_lams=(0.1, 1.0))
    toy = E.lm_toy(cfg, 0)
    before = [p.clone() for p in toy.reference.parameters()]
    got = E.lm_sweep(toy, cfg, 0)
    assert list(got) == [("dpo", 0.1), ("dpo", 1.0), ("expo", 0.1), ("expo", 1.0)]
    assert all(torch.equal(a, b) for a, b in zip(before, toy.reference.parameters()))  # π_ref untouched
    import copy

    logp = E.train_lm("expo", copy.deepcopy(toy.reference), toy.prompts, toy.seqs, toy.ref_logp, toy.star_logp, 1.0,
                      V=cfg.V, steps=3, lr=cfg.lm_lr, batch=8, generator=torch.Generator().manual_seed(1), quiet=True)
    want = [sum(float(p.exp()) * (float(p) - float(q)) for p, q in zip(toy.star_logp[c], logp[c])) for c in range(2)]
    torch.testing.assert_close(got["expo", 1.0].double(), torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=0)
