import math

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


def test_the_official_code_bugs_and_their_fixes():
    # 1. overflow: the official sampler exponentiates raw rewards
    r = torch.tensor([1000.0, 999.0, 0.0], dtype=torch.float64)
    official = torch.exp(5.0 * r[1:])
    assert torch.isinf(official).any() and torch.isnan(official / official.sum()).any()
    # 2. sign: the official `hard` setting's γ = −5 samples the *easiest* negative
    assert hardness_weights(r[None], -5.0)[0].argmax() == 2 and hardness_weights(r[None], 5.0)[0].argmax() == 1
    # 3. the curriculum (official `hard_i`) is defined from the first sample (the code's first read fails)


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


def test_controls_replace_only_the_sampler():
    """`uniform` makes every HPS arm exactly DPO with a random negative (same draws, same weights, same label
    smoothing), whatever γ the arm asks for; `easy` forces γ = −5; neither touches the baselines' settings."""
    from dataclasses import replace

    from lab.align.hps import CONTROLS, Config, make_toy, train

    base = replace(Config.for_scale("smoke"), n_prompts=3, sft_steps=5, d_model=16, steps=4)
    uni = replace(Config.for_scale("smoke", "uniform"), n_prompts=3, sft_steps=5, d_model=16, steps=4)
    easy = Config.for_scale("smoke", "easy")
    assert (base.forced_gamma, uni.forced_gamma, easy.forced_gamma) == (None, 0.0, -5.0)
    assert replace(uni, forced_gamma=None) == base and set(CONTROLS) == {"uniform", "easy"}
    assert base.label_smoothing == 0.1 and base.beta == 0.25  # the official training config
    toy = make_toy(base, 0)
    b = train("dpo random", toy, base, 0)
    for arm, gamma in (("hps", None), ("hps", 2.0), ("hps curriculum", None)):
        a = train(arm, toy, uni, 0, gamma=gamma)
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    c = train("hps", toy, base, 0)  # the paper's γ = 5 does move differently
    assert any(not torch.equal(p, q) for p, q in zip(b.parameters(), c.parameters()))
    with pytest.raises(ValueError, match="unknown control"):
        Config.for_scale("smoke", "nonsense")


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
