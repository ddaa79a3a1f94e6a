import math

import numpy as np
import pytest
import torch

from lab.align.hps import gamma_schedule, hardness_weights, hps, sample_negative
from lab.align.losses import dpo


def test_sampler_frequencies_follow_softmax_over_the_negatives():
    r = torch.tensor([[1.0, 0.8, 0.2, -0.5, 0.999]])
    g = torch.Generator().manual_seed(0)
    idx = sample_negative(r.expand(100_000, -1), 2.0, g)
    freq = torch.bincount(idx, minlength=5).double() / len(idx)
    neg = torch.tensor([False, True, True, True, True])
    want = torch.zeros(5, dtype=torch.float64)
    want[neg] = torch.softmax(2.0 * r[0, neg].double(), 0)
    assert freq[0] == 0  # the best is never its own negative
    torch.testing.assert_close(freq, want, atol=4e-3, rtol=0)


def test_gamma_zero_is_uniform_and_large_gamma_picks_the_runner_up():
    r = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    torch.testing.assert_close(hardness_weights(r, 0.0)[0, 1:], torch.full((3,), 1 / 3, dtype=torch.float64))
    assert hardness_weights(r, 200.0)[0].argmax() == 1 and hardness_weights(r, 200.0)[0, 1] > 0.999
    assert hardness_weights(r, -200.0)[0].argmax() == 3  # negative γ: easy negatives


def test_no_overflow_and_ties_with_the_best_are_excluded():
    w = hardness_weights(torch.tensor([[1000.0, 999.0, 0.0]]), 5.0)
    assert torch.isfinite(w).all() and w[0, 1] == pytest.approx(1.0)
    assert hardness_weights(torch.tensor([[1.0, 1.0, 0.0]]), 5.0)[0].tolist() == [0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="no response below its best"):
        hardness_weights(torch.tensor([[1.0, 1.0]]), 1.0)


def official_sampler_probs(rewards, gamma):
    """What the released `weighted_uniform_sample` draws its negative from, transcribed in spirit (numpy, float64,
    no max-subtraction): the responses whose exp(reward) equals the largest exp(reward) are dropped, the rest are
    weighted by exp(γ·reward) and normalised. Returns the probability of each index (NaN where the weights
    overflow; a prompt with nothing left is not handled here)."""
    r = np.asarray(rewards, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(r)
        keep = e != e.max()
        w = np.exp(gamma * r[keep])
        p = np.zeros(len(r))
        p[keep] = w / w.sum()
    return p


def test_the_official_sampler_overflows_where_hardness_weights_does_not():
    # r = [1000, 999, 0]: exp overflows to inf for both 1000 and 999, so the official sampler drops the hardest
    # negative as a "tie" with the best and always returns the easiest one
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(np.array([1000.0, 999.0]))).all()
    assert official_sampler_probs([1000.0, 999.0, 0.0], 5.0).tolist() == [0.0, 0.0, 1.0]
    w = hardness_weights(torch.tensor([[1000.0, 999.0, 0.0]]), 5.0)[0]
    assert w[1] == pytest.approx(1.0) and w[2] < 1e-300
    # the weights themselves overflow once γ·r > 709: inf / inf
    assert np.isnan(official_sampler_probs([1000.0, 150.0, 149.0], 5.0)[1:]).all()
    torch.testing.assert_close(hardness_weights(torch.tensor([[1000.0, 150.0, 149.0]]), 5.0)[0],
                               torch.tensor([0.0, 1 / (1 + math.exp(-5)), 1 / (1 + math.exp(5))], dtype=torch.float64))
    # sign: the official `hard` setting's γ = −5 favours the easiest negative
    r = torch.tensor([[1.0, 0.9, -1.0]])
    assert hardness_weights(r, -5.0)[0].argmax() == 2 and hardness_weights(r, 5.0)[0].argmax() == 1


@pytest.mark.parametrize("gamma", [-5.0, -2.0, 0.0, 2.0, 5.0, 40.0])
def test_hardness_weights_match_the_official_sampler_where_it_does_not_overflow(gamma):
    g = torch.Generator().manual_seed(int(gamma) + 100)
    r = torch.randn(20, 7, generator=g, dtype=torch.float64) * 3
    r[0, 3] = r[0].max()  # a tie with the best: excluded by both
    r[1, 1:4] = r[1, 0]  # so is a three-way tie
    got = hardness_weights(r, gamma)
    want = torch.tensor(np.stack([official_sampler_probs(row.tolist(), gamma) for row in r]))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-300)


def official_hard_i(n: int) -> list[float]:
    """The released `prepare_data` loop's γ per sample (its global γ initialised, as it must be to run)."""
    update_points = [int(n * frac) for frac in [0.2, 0.4, 0.6, 0.8]]
    gamma_i, out = -5, []
    for i in range(n):
        if i in update_points:
            gamma_i = -5 + 10 * (i / (n - 1))
        out.append(gamma_i)
    return out


@pytest.mark.parametrize("n", [5, 10, 30, 100, 1001])
def test_gamma_schedule_is_the_official_hard_i_curriculum(n):
    got = [gamma_schedule(i, n) for i in range(n)]
    assert got == pytest.approx(official_hard_i(n), abs=1e-12)
    if n >= 100:  # −5 until 20 % of the data, then about −3, −1, +1, +3; never +5
        assert got[: int(0.2 * n)] == [-5.0] * int(0.2 * n) and max(got) < 3.5
        assert sorted(set(round(g) for g in got)) == [-5, -3, -1, 1, 3]


def test_hps_with_one_negative_is_dpo_and_the_paper_normalizer():
    """The default is the released code's form (DPO on the pair, with its label smoothing); the paper's
    −log(n−1) normalizer only when asked for."""
    torch.manual_seed(0)
    pi, ref = torch.randn(6, 2, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    r = torch.tensor([[1.0, 0.0]]).expand(6, -1)
    torch.testing.assert_close(hps(pi, ref, beta=0.25, r=r), dpo(pi, ref, beta=0.25))
    torch.testing.assert_close(hps(pi, ref, beta=0.25, r=r, label_smoothing=0.1),
                               dpo(pi, ref, beta=0.25, label_smoothing=0.1))
    z = 0.25 * ((pi - ref)[:, 0] - (pi - ref)[:, 1])  # conservative DPO by hand: ε = 0.1
    torch.testing.assert_close(hps(pi, ref, beta=0.25, r=r, label_smoothing=0.1),
                               -0.9 * torch.nn.functional.logsigmoid(z) - 0.1 * torch.nn.functional.logsigmoid(-z))
    with pytest.raises(ValueError, match="label smoothing"):
        hps(pi, ref, r=r, label_smoothing=0.1, normalizer=True)
    pi3, ref3 = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    r3 = torch.tensor([[0.0, 1.0, -1.0]]).expand(6, -1)  # best is column 1
    g = torch.Generator().manual_seed(1)
    got = hps(pi3, ref3, beta=0.5, r=r3, gamma=1e4, generator=g, normalizer=True)  # γ → ∞: the runner-up (col. 0)
    h = pi3 - ref3
    want = torch.nn.functional.softplus(-(0.5 * (h[:, 1] - h[:, 0]) - math.log(2)))
    torch.testing.assert_close(got, want)
    code_form = hps(pi3, ref3, beta=0.5, r=r3, gamma=1e4)
    torch.testing.assert_close(code_form, torch.nn.functional.softplus(-(0.5 * (h[:, 1] - h[:, 0]))))


def test_the_toy_candidates_rewards_and_metrics():
    from lab.align.hps import Config, make_toy, metrics

    cfg = Config(n_prompts=3, sft_steps=5, d_model=16)
    toy = make_toy(cfg, 0)
    HARM = cfg.V - 1
    assert toy.cands.shape == (3, 1 + cfg.n_hard + cfg.n_easy, cfg.L)
    for c in range(3):
        best, hard, easy = toy.cands[c, 0], toy.cands[c, 1:1 + cfg.n_hard], toy.cands[c, 1 + cfg.n_hard:]
        assert (best != HARM).all() and (easy != HARM).all()
        assert ((hard != best).sum(-1) == 1).all() and (hard == HARM).sum() == cfg.n_hard  # one token -> HARM
        assert toy.r[c, 0] == 1 and (toy.r[c, 1:1 + cfg.n_hard] >= 0.6).all() and (toy.r[c, 1 + cfg.n_hard:] <= 0).all()
    m = metrics(toy.reference, toy, cfg)
    assert 0 <= m["harm"] <= 1 and 0 <= m["p_best"] + m["p_hard"] + m["p_easy"] <= 1 + 1e-6


def test_shuffle_negatives_permutes_each_rows_negatives_uniformly():
    from lab.align.hps import shuffle_negatives

    r = torch.tensor([[1.0, 0.8, 0.2, -0.5], [2.0, 2.0, 0.0, 1.0], [0.0, 3.0, 1.0, 2.0]])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([shuffle_negatives(r, g) for _ in range(6000)])  # (D, 3, 4)
    best = r == r.max(-1, keepdim=True).values
    assert (draws[:, best] == r[best]).all()  # the best and its ties never move
    for row in range(3):  # each row keeps its own rewards, each negative position sees each of them 1/k of the time
        neg = (~best[row]).nonzero()[:, 0]
        vals = r[row, neg]
        assert (draws[:, row, neg].sort(-1).values == vals.sort().values).all()
        for j in neg:
            freq = torch.stack([(draws[:, row, j] == v).double().mean() for v in vals])
            torch.testing.assert_close(freq, torch.full_like(freq, 1 / len(vals)), atol=0.03, rtol=0)


def test_pick_lrs_takes_the_largest_margin_that_keeps_the_best_response():
    from lab.align.hps import pick_lrs

    table = {"a": {"0.0003": {"margin": 3.0, "p_best": 0.6}, "0.001": {"margin": 5.0, "p_best": 0.3},
                   "0.003": {"margin": 9.0, "p_best": 0.01}},  # the largest margin, but the mass left the best
             "b": {"0.0003": {"margin": 3.0, "p_best": 0.05}, "0.001": {"margin": 2.0, "p_best": 0.1}}}
    assert pick_lrs(table, 8) == {"a": 1e-3, "b": 1e-3}  # b: none keeps 1/8, so the largest mass on the best
    assert pick_lrs(table, 200) == {"a": 3e-3, "b": 3e-4}


def test_arm_lrs_follow_the_recorded_tuning_table():
    import json
    from pathlib import Path

    from lab.align.hps import Config, arms, pick_lrs

    cfg = Config()
    rec = json.loads((Path(__file__).parents[2] / "notebooks/results/tuning/11_hps.json").read_text())
    assert set(rec["table"]) == set(arms(cfg))
    assert all(list(t) == [str(x) for x in cfg.lrs] for t in rec["table"].values())
    assert pick_lrs(rec["table"], 1 + cfg.n_hard + cfg.n_easy) == dict(cfg.arm_lrs) == rec["lrs"]
    assert min(rec["tune_seeds"]) >= cfg.tune_offset  # held out from the measured seeds 0-9


def _small(control=""):
    from dataclasses import replace

    from lab.align.hps import Config

    return replace(Config.for_scale("smoke", control), n_prompts=3, sft_steps=5, d_model=16, steps=4)


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_controls_change_only_what_they_name():
    """`easy` forces γ = −5 in every HPS arm; `shuffled_rewards` hands HPS's sampler the rewards permuted among
    each prompt's negatives (the permutation from seed + 1). The baselines, the learning rates, the metrics and
    every other setting stay."""
    from dataclasses import replace

    from lab.align.hps import CONTROLS, Config, Toy, make_toy, metrics, shuffle_negatives, train

    base, easy, shuf = _small(), _small("easy"), _small("shuffled_rewards")
    assert set(CONTROLS) == {"easy", "shuffled_rewards"}
    assert (easy.forced_gamma, easy.shuffled_rewards) == (-5.0, False)
    assert (shuf.forced_gamma, shuf.shuffled_rewards) == (None, True)
    assert replace(easy, forced_gamma=None) == base == replace(shuf, shuffled_rewards=False)
    assert base.label_smoothing == 0.1 and base.beta == 0.25  # the official training config
    toy = make_toy(base, 0)
    for method in ("dpo max-min", "dpo random", "pl"):
        b = train(method, toy, base, 0, lr=1e-3)
        assert _same(b, train(method, toy, easy, 0, lr=1e-3)) and _same(b, train(method, toy, shuf, 0, lr=1e-3))
    seen = Toy(toy.reference, toy.prompts, toy.cands, shuffle_negatives(toy.r, torch.Generator().manual_seed(1)))
    assert not torch.equal(seen.r, toy.r)
    for arm, gamma in (("hps", None), ("hps", -2.0), ("hps curriculum", None)):
        assert _same(train(arm, toy, easy, 0, gamma=gamma), train("hps", toy, base, 0, gamma=-5.0))
        s = train(arm, toy, shuf, 0, gamma=gamma)
        assert _same(s, train(arm, seen, base, 0, gamma=gamma)) and not _same(s, train(arm, toy, base, 0, gamma=gamma))
        assert metrics(s, toy, shuf) == metrics(s, toy, base)  # the metrics keep the true rewards
    # a sanity, not a control: with γ = 0 every HPS arm is DPO with a random negative, bit for bit
    uni = replace(base, forced_gamma=0.0)
    assert _same(train("hps curriculum", toy, uni, 0), train("dpo random", toy, base, 0))
    with pytest.raises(ValueError, match="unknown control"):
        Config.for_scale("smoke", "nonsense")


def test_run_arms_trains_each_arm_at_its_learning_rate():
    from lab.align.hps import arms, make_toy, metrics, run_arms, sweep_arm, train

    cfg = _small()
    toy = make_toy(cfg, 0)
    policies, results = run_arms(toy, cfg, 0, quiet=True)
    assert set(policies) == set(arms(cfg)) == {"dpo max-min", "dpo random", "pl", "hps", "hps curriculum",
                                                 "hps γ=-5", "hps γ=-2", "hps γ=+2"}
    assert [sweep_arm(cfg, g) for g in cfg.gammas] == ["hps γ=-5", "hps γ=-2", "dpo random", "hps γ=+2", "hps"]
    lrs = dict(cfg.arm_lrs)
    for name, (method, gamma) in arms(cfg).items():
        assert _same(policies[name], train(method, toy, cfg, 0, gamma=gamma, lr=lrs[name]))
    assert results["hps γ=-5"] == metrics(train("hps", toy, cfg, 0, gamma=-5.0, lr=lrs["hps γ=-5"]), toy, cfg)


def test_sft_and_preference_training_are_plain_adam_loops_bit_for_bit():
    """`make_toy`'s SFT and `train` run through `lab.align.train.optimize`: the same parameters as hand-written
    Adam loops (the curriculum's γ by step, one sampler draw per step from the seeded generator)."""
    import copy
    from dataclasses import replace

    from lab.align.exact import seq_logprobs
    from lab.align.hps import Config, candidate_logprobs, make_toy, train
    from lab.models import tiny_llama

    cfg = replace(Config(), n_prompts=3, sft_steps=6, d_model=16, steps=5)
    toy = make_toy(cfg, 0, quiet=True)
    torch.manual_seed(0)
    naive = tiny_llama(vocab_size=cfg.V + 3, d_model=16, n_layers=2, n_heads=4, max_len=cfg.L + 1)
    opt = torch.optim.Adam(naive.parameters(), lr=cfg.sft_lr)
    for _ in range(cfg.sft_steps):
        (-seq_logprobs(naive, toy.prompts, toy.cands, cfg.V).mean()).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(toy.reference.parameters(), naive.parameters()))

    with torch.no_grad():
        ref = seq_logprobs(toy.reference, toy.prompts, toy.cands, cfg.V)
    torch.testing.assert_close(candidate_logprobs(toy.reference, toy, cfg), ref, rtol=0, atol=0)
    cfg = replace(cfg, steps=10)
    policy = train("hps curriculum", toy, cfg, 7, quiet=True)
    naive, g = copy.deepcopy(toy.reference).train(), torch.Generator().manual_seed(7)
    opt = torch.optim.Adam(naive.parameters(), lr=cfg.lr)
    for gamma in official_hard_i(cfg.steps):  # step i of the run is sample i of the official loop
        pi = seq_logprobs(naive, toy.prompts, toy.cands, cfg.V)
        hps(pi, ref, beta=cfg.beta, r=toy.r, gamma=gamma, generator=g, label_smoothing=0.1).mean().backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), naive.parameters()))
