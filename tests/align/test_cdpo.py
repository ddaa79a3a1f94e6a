import copy
import itertools
import math
from dataclasses import FrozenInstanceError, replace

import pytest
import torch
import torch.nn.functional as F

from lab.align import LOSSES
from lab.align import cdpo as C
from lab.align import critical_tokens as CT
from lab.align.train import response_logps
from lab.data.arith import TrickyArithmetic
from lab.models import TrainConfig, fit, tiny_llama
from lab.models.sample import mean_pass_at_k, pass_at_k, sample

from .stubs import V, always


def rand_logps(B=4, L=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [-torch.rand(B, L, generator=g) * 3 for _ in range(4)]


def test_cdpo_is_dpo_when_no_token_is_critical_and_drops_fully_critical_rejected_terms():
    pi_w, ref_w, pi_l, ref_l = rand_logps()
    zero, one = torch.zeros(4, 5), torch.ones(4, 5)
    dpo = LOSSES["dpo"](torch.stack([pi_w.sum(1), pi_l.sum(1)], 1), torch.stack([ref_w.sum(1), ref_l.sum(1)], 1),
                        beta=0.3)
    torch.testing.assert_close(C.cdpo_loss(pi_w, ref_w, pi_l, ref_l, zero, gamma=0.3), dpo, atol=1e-6, rtol=0)
    only_w = -F.logsigmoid(0.3 * (pi_w - ref_w).sum(1))
    torch.testing.assert_close(C.cdpo_loss(pi_w, ref_w, pi_l, ref_l, one, gamma=0.3), only_w, atol=1e-6, rtol=0)


def test_positionwise_variant_by_hand_and_bad_variant():
    pi_w, ref_w, pi_l, ref_l = rand_logps(B=2, L=3, seed=1)
    s = torch.tensor([[0.0, 0.5, 1.0], [0.2, 0.2, 0.9]])
    want = torch.tensor([sum(-math.log(1 / (1 + math.exp(-0.5 * ((pi_w[b, t] - ref_w[b, t])
                                                                 - (1 - s[b, t]) * (pi_l[b, t] - ref_l[b, t])).item())))
                             for t in range(3)) / 3 for b in range(2)])
    got = C.cdpo_loss(pi_w, ref_w, pi_l, ref_l, s, gamma=0.5, variant="official_positionwise")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="variant"):
        C.cdpo_loss(pi_w, ref_w, pi_l, ref_l, s, variant="sum")


def test_scores_get_no_gradient_and_the_weights_scale_the_rejected_gradient():
    pi_w, ref_w, pi_l, ref_l = rand_logps(B=1, L=4, seed=2)
    pi_l.requires_grad_(True)
    s = torch.tensor([[0.0, 1.0, 0.5, 0.25]], requires_grad=True)
    C.cdpo_loss(pi_w, ref_w, pi_l, ref_l, s).sum().backward()
    assert s.grad is None or torch.all(s.grad == 0)
    g = pi_l.grad[0]
    assert g[1] == 0 and torch.allclose(g[2], 0.5 * g[0]) and torch.allclose(g[3], 0.75 * g[0])


def test_pass_at_k_matches_brute_force():
    for n, c, k in [(6, 0, 2), (6, 2, 1), (6, 2, 3), (5, 5, 4), (7, 3, 7)]:
        outcomes = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(range(n), k))
        brute = sum(any(outcomes[i] for i in sub) for sub in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute)


def test_selection_follows_the_official_rules():
    # answers of 10 samples; correct answer 7 (never -1)
    answers = torch.tensor([[7, 3, 3, 3, 5, 5, 2, 7, -1, 4],
                            [7, 7, 7, 7, 7, 7, 7, 7, 7, 7],
                            [1, 1, 2, -1, 3, 4, 5, 6, 8, 9]])
    correct = answers == 7
    sel = C.select(answers, correct, top_p=0.5)
    # wrong parsable: 3x3, 5x2, 2, 4 (7 samples): 3 covers 3/7 < 0.5, 5 (count 2) brings 5/7 -> stop
    assert sel[0] == {"pos": 0, "neg": [1, 4]}
    # each side is chosen independently (official): a question with no wrong answer still feeds P_p, one with no
    # correct answer still feeds P_n (1 twice covers 2 of 9 wrong samples; the singles after it are not added)
    assert sel[1] == {"pos": 0, "neg": []} and sel[2] == {"pos": None, "neg": [0]}
    # after the first, answers seen once are not added
    only_singles = C.select(torch.tensor([[7, 1, 2, 3, 4]]), torch.tensor([[True, False, False, False, False]]))
    assert only_singles[0] == {"pos": 0, "neg": [1]}


def test_ce_scores_equal_the_log_prob_formula_and_flag_the_negative_models_token():
    torch.manual_seed(0)
    pos, neg = (tiny_llama(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=16).eval() for _ in range(2))
    x, y = torch.randint(V, (3, 4)), torch.randint(V, (3, 5))
    ids = torch.cat([x, y], 1)
    lp = pos(input_ids=ids).logits[:, 3:-1].log_softmax(-1)
    ln = neg(input_ids=ids).logits[:, 3:-1].log_softmax(-1)
    want = ((2 * lp - ln).log_softmax(-1)).gather(-1, y[..., None])[..., 0].exp()  # beta = 1, normalised over V
    torch.testing.assert_close(C.ce_scores(pos, neg, x, y, beta=1.0), want.detach(), atol=1e-5, rtol=1e-4)
    p_pos = lp.exp().gather(-1, y[..., None])[..., 0].detach()
    torch.testing.assert_close(C.ce_scores(pos, neg, x, y, beta=0.0), p_pos)
    # stubs: the positive model writes 5, the negative one 7; a rejected trajectory with 7 at position 2
    y = torch.tensor([[5, 5, 7, 5, 5]])
    s = C.ce_scores(always(5), always(7), torch.tensor([[1, 2]]), y)
    assert int(s.argmin()) == 2
    # the named wrong variant: positive and negative models swapped -> the critical token is missed
    assert int(C.ce_scores(always(7), always(5), torch.tensor([[1, 2]]), y).argmin()) != 2


def test_sample_shapes_greedy_and_ban():
    g = torch.Generator().manual_seed(0)
    out = C.sample_responses(always(5), torch.tensor([[1, 2], [3, 4]]), 3, 4, generator=g)
    assert out.shape == (2, 3, 4) and (out == 5).all()
    banned = sample(always(5), torch.tensor([[1, 2]]), 2, generator=g, temperature=0, ban=torch.tensor([5]))
    assert banned[0, 0] != 5 and banned[0, 1] == 5


def test_each_arms_gradient_at_the_reference_is_its_closed_form():
    """At π_θ = π_ref (h = 0, σ' = 1/4) the batch-mean loss of each arm has a closed-form gradient in the
    per-token log-probs: DPO ∓γ/2B on every chosen / rejected token; RPO adds −1/(B·L) on the chosen tokens
    (its per-token NLL); cDPO scales the rejected token t by (1 − s_t); the position-wise cDPO divides both by L."""
    B, L, gamma = 3, 4, 0.5
    ref_w, ref_l = rand_logps(B, L, seed=3)[:2]
    s = torch.rand(B, L, generator=torch.Generator().manual_seed(4))
    one = torch.ones(B, L)
    want = {"dpo": (-gamma / 2 / B * one, gamma / 2 / B * one),
            "rpo": ((-gamma / 2 / B - 1 / (B * L)) * one, gamma / 2 / B * one),
            "cdpo": (-gamma / 2 / B * one, gamma / 2 / B * (1 - s)),
            "cdpo_positionwise": (-gamma / 2 / (B * L) * one, gamma / 2 / (B * L) * (1 - s)),
            "tokendpo": (-gamma / 2 / B * one, gamma / 2 / B * one)}  # its sequential KLs are 0 at π_ref
    for arm, (g_w, g_l) in want.items():
        pi_w, pi_l = ref_w.clone().requires_grad_(), ref_l.clone().requires_grad_()
        value = C.arm_loss(arm, pi_w, ref_w, pi_l, ref_l, s, gamma=gamma, kl=torch.zeros(B, 2))
        nll = -ref_w.sum(1).mean().item() / L if arm == "rpo" else 0.0
        assert value.item() == pytest.approx(math.log(2) + nll, abs=1e-6), arm
        value.backward()
        torch.testing.assert_close(pi_w.grad, g_w, msg=arm)
        torch.testing.assert_close(pi_l.grad, g_l, msg=arm)


def test_training_arms_and_sft_run_and_log():
    torch.manual_seed(0)
    base = tiny_llama(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=16).eval()
    x, yw, yl = torch.randint(V, (8, 3)), torch.randint(V, (8, 4)), torch.randint(V, (8, 4))
    pairs = {"prompt": x, "chosen": yw, "rejected": yl, "s": torch.rand(8, 4)}
    w0 = [p.clone() for p in base.parameters()]
    train = lambda arm, p=pairs, steps=6: C.train_arm(base, p, arm, steps=steps, lr=1e-2, gamma=0.5, batch_size=4,
                                                       every=3, quiet=True)
    runs = {arm: train(arm) for arm in ("dpo", "rpo", "cdpo", "cdpo_positionwise", "tokendpo")}
    for _policy, log in runs.values():
        assert log["step"] == [0, 3, 6] and len(log["loss"]) == 6
        assert log["rejected"][-1] < log["rejected"][0]  # every arm pushes the rejected responses down
    assert all(torch.equal(a, b) for a, b in zip(w0, base.parameters()))  # the reference is untouched
    # cDPO with every s_t = 0 is DPO: the same batches give the same log and the same policy ...
    dpo_like, log0 = train("cdpo", {**pairs, "s": torch.zeros(8, 4)})
    assert all(log0[k] == pytest.approx(v, abs=1e-5) for k, v in runs["dpo"][1].items())
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(dpo_like.parameters(), runs["dpo"][0].parameters()))
    # ... while the real scores, RPO's NLL term, the position-wise mean and TDPO's KL term make five policies
    for a, b in itertools.combinations(runs, 2):
        gap = max((p - q).abs().max().item() for p, q in zip(runs[a][0].parameters(), runs[b][0].parameters()))
        assert gap > 1e-3, (a, b)
    # the first logged loss is at π_θ = π_ref: log 2 for the DPO family, plus the chosen per-token NLL for RPO
    # (one shared prompt and chosen response, so every batch has the same NLL, computed here from the logits)
    same = {**pairs, "prompt": x[:1].expand(8, -1), "chosen": yw[:1].expand(8, -1)}
    with torch.no_grad():
        logp = base(input_ids=torch.cat([x[:1], yw[:1]], 1)).logits[0, 2:-1].log_softmax(-1)  # predicts yw
    nll = -sum(logp[t, yw[0, t]] for t in range(4)).item() / 4
    for arm in ("dpo", "cdpo", "cdpo_positionwise", "rpo", "tokendpo"):
        first = train(arm, same, steps=1)[1]["loss"][0]
        assert first == pytest.approx(math.log(2) + (nll if arm == "rpo" else 0.0), abs=1e-5), arm
    losses = C.fine_tune(base, x, yw, steps=30, lr=1e-2, batch_size=8, quiet=True)
    assert losses[-1] < losses[0]


# --------------------------------------------------------------- the notebook's controls (C.CONTROLS)

def test_controls_substitute_exactly_what_they_name():
    """`swapped_ce` exchanges P_p and P_n in CE; `dpo` zeroes cDPO's token weights (cDPO is then DPO, so its
    loss equals DPO's); `random_token` replaces the rollout critical token by a random position; an unknown
    control is rejected."""
    pos, neg = always(3), always(5)
    assert C.ce_models(pos, neg) == (pos, neg) and C.ce_models(pos, neg, "dpo") == (pos, neg)
    assert C.ce_models(pos, neg, "swapped_ce") == (neg, pos)
    x, y = torch.tensor([[1, 2]]), torch.tensor([[3, 5, 3]])
    s, s_sw = C.ce_scores(pos, neg, x, y), C.ce_scores(*C.ce_models(pos, neg, "swapped_ce"), x, y)
    assert s.argmin().item() == 1 and s_sw.argmin().item() != 1  # the swap hides the token P_n prefers
    pi_w, ref_w, pi_l, ref_l = rand_logps(seed=5)
    w = torch.rand(4, 5, generator=torch.Generator().manual_seed(6))
    assert torch.equal(C.training_scores(w), w) and torch.equal(C.training_scores(w, "swapped_ce"), w)
    dpo = C.arm_loss("dpo", pi_w, ref_w, pi_l, ref_l, w, gamma=0.3)
    as_dpo = C.arm_loss("cdpo", pi_w, ref_w, pi_l, ref_l, C.training_scores(w, "dpo"), gamma=0.3)
    assert as_dpo.item() == pytest.approx(dpo.item(), abs=1e-6)
    assert C.arm_loss("cdpo", pi_w, ref_w, pi_l, ref_l, w, gamma=0.3).item() != pytest.approx(dpo.item(), abs=1e-3)
    for name in ("uniform_s", "shuffled_s"):  # they change the training scores only
        assert C.ce_models(pos, neg, name) == (pos, neg)
        assert CT.critical_or_random(torch.tensor([[0.5, 0.0, 0.0]]), name).tolist() == [1]
    c = torch.tensor([[0.5, 0.0, 0.0, 0.0, 0.0]] * 200)
    assert (CT.critical_or_random(c) == 1).all()
    rnd = CT.critical_or_random(c, "random_token", generator=torch.Generator().manual_seed(0))
    assert rnd.shape == (200,) and set(rnd.tolist()) == set(range(5))
    with pytest.raises(ValueError, match="not a control"):
        C.ce_models(pos, neg, "swap_ce")


def test_uniform_and_shuffled_scores_keep_each_trajectorys_weights_and_move_only_where_they_fall():
    """`uniform_s`: every s_t of a row is that row's mean (a hand-written loop); `shuffled_s`: each row is a
    permutation of itself (the same multiset of weights), fixed by the seed, and differs from s somewhere."""
    s = torch.rand(6, 5, generator=torch.Generator().manual_seed(7))
    uni = C.training_scores(s, "uniform_s")
    for i in range(6):
        m = sum(s[i].tolist()) / 5
        assert uni[i].tolist() == pytest.approx([m] * 5, abs=1e-6)
    sh = C.training_scores(s, "shuffled_s", seed=3)
    for i in range(6):
        assert sorted(sh[i].tolist()) == sorted(s[i].tolist())
    assert not torch.equal(sh, s) and torch.equal(sh, C.training_scores(s, "shuffled_s", seed=3))
    assert not torch.equal(sh, C.training_scores(s, "shuffled_s", seed=4))
    # with a uniform weight cDPO's rejected term is the row's mean weight times DPO's: a hand-written loss
    pi_w, ref_w, pi_l, ref_l = rand_logps(B=6, L=5, seed=8)
    margin = [(pi_w[i] - ref_w[i]).sum().item() - (1 - uni[i, 0].item()) * (pi_l[i] - ref_l[i]).sum().item()
              for i in range(6)]
    want = torch.tensor([-math.log(1 / (1 + math.exp(-0.2 * mg))) for mg in margin])
    torch.testing.assert_close(C.cdpo_loss(pi_w, ref_w, pi_l, ref_l, uni, gamma=0.2), want, atol=1e-5, rtol=0)


def test_config_gamma_per_arm_or_one_for_all():
    cfg = C.Config()
    assert cfg.gamma() == {"dpo": 1.0, "rpo": 0.1, "tokendpo": 0.1, "cdpo": 0.5, "cdpo_positionwise": 0.1}
    assert cfg.gamma(0.3) == dict.fromkeys(cfg.arms, 0.3)


# ------------------------------------------------------------------------------ the toy's pipeline

def test_fine_tune_is_the_hand_written_adam_sft_loop():
    """`fine_tune` runs through `optimize`: the same batches, losses and weights as a plain Adam loop."""
    torch.manual_seed(1)
    base = tiny_llama(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=16).eval()
    x, y = torch.randint(V, (10, 3)), torch.randint(V, (10, 4))
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    losses = C.fine_tune(model, x, y, steps=7, lr=1e-2, batch_size=4, seed=3, quiet=True)
    g, opt, want = torch.Generator().manual_seed(3), torch.optim.Adam(ref.parameters(), lr=1e-2), []
    ref.train()
    for _ in range(7):
        i = torch.randint(10, (4,), generator=g)
        loss = -response_logps(ref, x[i], y[i]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(loss.item())
    assert losses == want and not model.training
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_config_lists_the_sizes_of_each_scale():
    smoke, full = C.Config.for_scale("smoke"), C.Config.for_scale("full", "dpo")
    assert (smoke.n_test, smoke.n_train, smoke.n_samples, smoke.sft_steps, smoke.K, smoke.n_rollout, smoke.steps) == \
        (500, 300, 16, 200, 16, 100, 150)
    assert (full.n_test, full.n_train, full.n_samples, full.sft_steps, full.K, full.n_rollout, full.steps) == \
        (2000, 1000, 64, 600, 64, 300, 600)
    assert smoke.lrs == (0.0, 3e-5, 1e-4, 3e-4, 1e-3) and full.lrs == (0.0, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3)
    assert (smoke.n_val, full.n_val) == (300, 1000)
    assert smoke.task() == TrickyArithmetic(flip=0.6, max_step=2, n_wordings=48)
    with pytest.raises(FrozenInstanceError):
        smoke.K = 2
    with pytest.raises(ValueError, match="not a control"):
        C.Config.for_scale("smoke", "nope")


def test_mean_pass_at_k_matches_brute_force():
    ok = torch.tensor([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    for k in (1, 2, 3):
        brute = [sum(any(row[i] for i in sub) for sub in itertools.combinations(range(4), k))
                 / math.comb(4, k) for row in ok.tolist()]
        assert mean_pass_at_k(ok, [k])[0] == pytest.approx(sum(brute) / 3)


def test_best_lrs_by_run_and_chosen_drop_by_hand():
    res = {("dpo", 1e-4): {"val": {"all": 0.5}, "acc": {"all": 0.5}, "log": {"chosen": [-3.0, -5.0]}},
           ("dpo", 3e-4): {"val": {"all": 0.5}, "acc": {"all": 0.9}, "log": {"chosen": [-3.0, -9.0]}},
           ("cdpo", 1e-4): {"val": {"all": 0.6}, "acc": {"all": 0.4}, "log": {"chosen": [-3.0, -2.5]}},
           ("cdpo", 3e-4): {"val": {"all": 0.5}, "acc": {"all": 0.7}, "log": {"chosen": [-3.0, -3.5]}}}
    # picked on the validation split, never on the test accuracy; a tie keeps the first lr
    assert C.best_lrs(res) == {"dpo": 1e-4, "cdpo": 1e-4}
    assert C.by_run(res) == {"dpo@0.0001": {"all": 0.5}, "dpo@0.0003": {"all": 0.9}, "cdpo@0.0001": {"all": 0.4},
                             "cdpo@0.0003": {"all": 0.7}}
    assert C.chosen_drop(res) == {"dpo@0.0001": 2.0, "dpo@0.0003": 6.0, "cdpo@0.0001": -0.5, "cdpo@0.0003": 0.5}


def test_pipeline_pairs_models_and_sweep_follow_the_steps_by_hand():
    task = TrickyArithmetic(flip=0.6, max_step=2)
    cfg = replace(C.Config(), base=replace(C.Config.base, steps=30), sft_steps=3, sft_batch=4, steps=2, batch_size=4,
                  every=1, arms=("dpo", "cdpo"), lrs=(1e-3,))
    run = C.base_model(task, cfg, seed=0, device="cpu")
    ref = fit(lambda: tiny_llama(vocab_size=len(task.tokenizer), d_model=64, n_layers=1, n_heads=4, max_len=16), task,
              TrainConfig(steps=30, batch_size=64, lr=3e-3, seed=0), cache=False)
    assert run.key == ref.key and all(torch.equal(a, b) for a, b in zip(run.model.parameters(), ref.model.parameters()))
    base = run.model
    q = task.questions(40, torch.Generator().manual_seed(1))
    data = C.preference_pairs(base, task, q, 8, generator=torch.Generator().manual_seed(2))
    samples = C.sample_responses(base, q["prompt"], 8, 5, generator=torch.Generator().manual_seed(2))
    assert torch.equal(data.correct, task.grade(q, samples))
    sel = C.select(task.final_answer(samples), data.correct)
    rows = [i for i, s in enumerate(sel) if s["pos"] is not None and s["neg"]]
    assert len(rows) > 0 and data.questions["prompt"].tolist() == data.prompts.tolist() == q["prompt"][rows].tolist()
    assert data.chosen.tolist() == [samples[i, sel[i]["pos"]].tolist() for i in rows]
    assert data.rejected.tolist() == [samples[i, sel[i]["neg"][0]].tolist() for i in rows]
    # P_p / P_n data: every question with a correct / a wrong sample, not only those that give a pair (official)
    has_pos = [i for i, s in enumerate(sel) if s["pos"] is not None]
    assert data.pos_responses.tolist() == [samples[i, sel[i]["pos"]].tolist() for i in has_pos]
    assert data.neg_responses.tolist() == [samples[i, j].tolist() for i, s in enumerate(sel) for j in s["neg"]]
    assert task.grade(data.questions, data.chosen).all() and not task.grade(data.questions, data.rejected).any()
    pos, neg = C.contrastive_models(base, data, cfg, seed=4)
    p_ref, n_ref = copy.deepcopy(base), copy.deepcopy(base)
    C.fine_tune(p_ref, data.pos_prompts, data.pos_responses, steps=3, lr=1e-3, batch_size=4, seed=4, quiet=True)
    C.fine_tune(n_ref, data.neg_prompts, data.neg_responses, steps=3, lr=1e-3, batch_size=4, seed=4, quiet=True)
    for a, b in ((pos, p_ref), (neg, n_ref)):
        assert all(torch.equal(u, v) for u, v in zip(a.parameters(), b.parameters()))
    pairs = {"prompt": data.prompts, "chosen": data.chosen, "rejected": data.rejected,
             "s": C.ce_scores(pos, neg, data.prompts, data.rejected)}
    test, val = (task.questions(30, torch.Generator().manual_seed(k)) for k in (5, 7))
    cfg = replace(cfg, lrs=(0.0, 1e-3))
    gammas = {"dpo": 0.1, "cdpo": 0.7}
    res = C.lr_sweep(base, pairs, cfg, gamma=gammas, seed=6, task=task, val=val, test=test)
    assert list(res) == [("dpo", 0.0), ("dpo", 1e-3), ("cdpo", 0.0), ("cdpo", 1e-3)]
    for arm in cfg.arms:
        policy, log = C.train_arm(base, pairs, arm, steps=2, lr=1e-3, gamma=gammas[arm], batch_size=4, seed=6, every=1,
                                  quiet=True)
        assert res[arm, 1e-3]["log"] == log
        with torch.no_grad():
            drop = response_logps(base, pairs["prompt"], pairs["rejected"]) - response_logps(
                policy, pairs["prompt"], pairs["rejected"])
        torch.testing.assert_close(res[arm, 1e-3]["rejected_drop"], drop, atol=1e-6, rtol=0)
        assert torch.equal(res[arm, 0.0]["rejected_drop"], torch.zeros_like(drop))
        for split, q in (("acc", test), ("val", val)):
            assert res[arm, 1e-3][split] == task.greedy_accuracy(policy, q, generator=torch.Generator())
            assert res[arm, 0.0][split] == task.greedy_accuracy(base, q, generator=torch.Generator())  # lr 0: the base
        w = response_logps(base, pairs["prompt"], pairs["chosen"]).sum(-1).mean().item()
        assert res[arm, 0.0]["log"]["chosen"] == [w, w] and res[arm, 0.0]["log"]["step"] == [0, cfg.steps]


@pytest.mark.parametrize("arm", ["dpo", "rpo", "cdpo", "cdpo_positionwise", "tokendpo"])
def test_arm_loss_stays_on_its_inputs_device(arm):
    """Every arm's loss is built on the device of its log-probs (here `meta`, standing in for CUDA: a host tensor
    mixed in raises, as on a GPU; rpo's per-token length was once made on the host)."""
    B, L = 3, 4
    t = lambda: torch.zeros(B, L, device="meta")
    kl = torch.zeros(B, 2, device="meta")
    assert C.arm_loss(arm, t(), t(), t(), t(), t(), gamma=0.5, kl=kl).device.type == "meta"
