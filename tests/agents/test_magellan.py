"""MAGELLAN: Little-Zoo's rules, the simulated learner, the samplers' arithmetic, the estimator, the goal-space swap,
the checkpoint path."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from lab.agents import little_zoo as lz
from lab.agents import magellan as mg
from lab.agents import magellan_study as ms

W, F, P, H, C = ("water", "water"), ("furniture", "chair"), ("plant", "carrot"), ("herbivore", "cow"), \
    ("carnivore", "lion")


@pytest.mark.parametrize("instr,target,scene,fam", [
    ("grasp", F, (F, P, H, W), 0),
    ("grasp", W, (F, P, H, W), 0),
    ("grasp", C, (F, P, H, W), 4),  # target absent
    ("grow", P, (P, W, F, H), 1),
    ("grow", P, (P, F, H, C), 4),  # no water
    ("grow", H, (H, W, P, F), 2),
    ("grow", H, (H, W, F, C), 4),  # no plant
    ("grow", C, (C, W, H, P), 3),
    ("grow", C, (C, W, H, F), 4),  # no plant
    ("grow", C, (C, W, P, F), 4),  # no herbivore
    ("grow", F, (F, W, P, H), 4),  # furniture cannot grow
    ("grow", W, (F, W, P, H), 4),  # water cannot grow
])
def test_family_follows_little_zoo_rules(instr, target, scene, fam):
    assert lz.family(instr, target, scene) == fam


def test_goal_space_has_the_paper_proportions_and_distinct_consistent_goals():
    sp = lz.make_goal_space(25_000, seed=1)
    assert np.bincount(sp.family, minlength=5).tolist() == [4001, 800, 160, 32, 20007]
    assert len(set(sp.goals)) == len(sp) == 25_000
    for g, f, tok in zip(sp.goals[:500], sp.family[:500], sp.tokens[:500]):
        assert lz.family(*g) == f
        words = [sp.words[t] for t in tok]
        assert words[0] == g[0] and tuple(words[1:3]) == g[1] and len(words) == 11
        assert sp.text(0).startswith("goal: ")
    assert [sp.words[t] for t in sp.target[:50]] == [g[1][1] for g in sp.goals[:50]]


def test_test_split_puts_a_held_out_target_in_a_scene_of_training_objects():
    test = lz.make_goal_space(2_000, seed=0, split="test")
    held_out, train = set(lz.objects("test")), set(lz.objects("train"))
    assert np.bincount(test.family, minlength=5).tolist() == list(lz.proportions(2_000))
    for (instr, target, scene), f in zip(test.goals, test.family):
        assert target in held_out and target in scene and lz.family(instr, target, scene) == f
        assert all(o in train for o in scene if o != target)


def _goal(sp, fam, avoid=()):
    return next(int(i) for i in np.flatnonzero(sp.family == fam) if sp.target[i] not in avoid)


def test_student_competence_and_update_by_hand():
    sp = lz.make_goal_space(600, seed=0)
    st = lz.Student(eta=0.5, init=0.5, transfer=0.25)
    c = st.competence(sp)
    assert np.allclose([c[sp.family == f].mean() for f in range(5)], [0.5, 0.25, 0.125, 0.0625, 0.0])
    h = _goal(sp, 2)
    h2 = _goal(sp, 2, avoid=(sp.target[h],))  # another herbivore name
    st.attempt(sp, np.array([h, _goal(sp, 4)]), np.random.default_rng(0))  # practise herbivore h
    step = 0.5 * 0.25 * 0.5  # η · s_g · s_p · (1 − ·)
    assert np.allclose(st.s, [0.5, 0.5, 0.5 + step, 0.5]) and st.v[sp.target[h]] == pytest.approx(0.5 + step)
    assert (np.delete(st.v, sp.target[h]) == 0.5).all()
    c = st.competence(sp)
    assert c[h] == pytest.approx(0.25 * (0.5 + step))  # τ s_h + (1 − τ) v_h, both moved
    assert c[h2] == pytest.approx(0.25 * (0.25 * (0.5 + step) + 0.75 * 0.5))  # only the shared part moved
    assert st.family_competence(sp)[4] == 0.0
    r = lz.Student(init=0.0).attempt(sp, np.array([_goal(sp, 0), _goal(sp, 1), _goal(sp, 4)]), np.random.default_rng(0))
    assert r.tolist() == [0, 0, 0]


def test_student_with_full_transfer_is_one_skill_per_family():
    sp = lz.make_goal_space(600, seed=0)
    st = lz.Student(eta=0.3, transfer=1.0)
    st.attempt(sp, np.random.default_rng(1).integers(0, 600, 300), np.random.default_rng(2))
    assert np.allclose(st.competence(sp), np.append(np.cumprod(st.s), 0.0)[sp.family])


def test_epsilon_schedule_and_eps_greedy():
    cfg = mg.Config(eps_start=1.0, eps_end=0.2, eps_decay=10.0)
    assert mg.epsilon(0, cfg) == pytest.approx(1.0)
    assert mg.epsilon(10, cfg) == pytest.approx(0.2 + 0.8 * np.exp(-1))
    p = mg.eps_greedy(np.array([0.0, 0.3, 0.1, 0.0]), 0.2)
    assert np.allclose(p, [0.05, 0.05 + 0.8 * 0.75, 0.05 + 0.8 * 0.25, 0.05])
    assert np.allclose(mg.eps_greedy(np.zeros(4), 0.2), 0.25)


def test_half_alp_and_recency_weights_by_hand():
    assert ms.half_alp([1]) == 0.0
    assert ms.half_alp([0, 0, 1, 1]) == pytest.approx(1.0)
    assert ms.half_alp([1, 0, 0, 1, 1]) == pytest.approx(abs(2 / 3 - 1 / 2))  # older = first n//2
    assert ms.half_alp([1, 1, 0, 0]) == pytest.approx(1.0)  # absolute: forgetting counts
    assert np.allclose(mg.recency_weights(4), np.array([1, 2, 3, 4]) / 10)


@pytest.fixture(scope="module")
def small():
    cfg = mg.Config.for_scale("smoke", n_goals=600, rounds=40, R=4, N=8, fifo=4, swap_rounds=12)
    return lz.make_goal_space(cfg.n_goals, 0), cfg


@pytest.fixture(scope="module")
def held_out(small):
    return lz.make_goal_space(small[1].n_goals, 0, split="test")


def test_online_alp_is_a_per_goal_fifo_and_the_swap_carries_buffers_by_rank_within_family(small, held_out):
    sp, cfg = small
    s = ms.OnlineALP(sp, cfg)
    seq = [1, 0, 0, 1, 1, 1]
    s.update(0, np.array([5] * len(seq)), np.array(seq, dtype=float))
    s.update(0, np.array([7]), np.array([1.0]))
    assert s.alp[5] == pytest.approx(ms.half_alp(seq[-4:])) and s.alp[7] == 0.0 and s.estimate[5] == 0.75
    assert np.isnan(s.estimate[8])
    s.swap(held_out)
    # by hand: goal 5 is the k-th of its family in the old space; the k-th of that family in the new space inherits it
    f5 = sp.family[5]
    k = int(np.flatnonzero(np.flatnonzero(sp.family == f5) == 5)[0])
    new5 = int(np.flatnonzero(held_out.family == f5)[k])
    assert list(s.fifos[new5]) == seq[-4:] and s.alp[new5] == pytest.approx(ms.half_alp(seq[-4:]))
    assert s.estimate[new5] == 0.75 and len(s.fifos) == 2 and s.space is held_out
    assert np.isnan(np.delete(s.estimate, list(s.fifos))).all()


def test_ek_probs_mix_buckets_then_uniform_inside(small):
    sp, cfg = small
    s = ms.EKOnlineALP(sp, cfg)
    fam = sp.family
    g_plant = np.flatnonzero(fam == 1)[0]
    s.update(0, np.array([g_plant] * 4), np.array([0, 0, 1, 1.0]))  # plant bucket ALP = 1, the others 0
    p, eps = s.probs(0), mg.epsilon(0, cfg)
    bucket = np.array([p[fam == f].sum() for f in range(5)])
    assert np.allclose(bucket, [eps / 5, eps / 5 + (1 - eps), eps / 5, eps / 5, eps / 5])
    assert np.allclose(p[fam == 1], p[fam == 1][0]) and p.sum() == pytest.approx(1.0)


def test_estimator_object_table_equals_a_naive_per_goal_encoder(small):
    sp, cfg = small
    torch.manual_seed(0)
    est = mg.Estimator(sp, cfg)
    idx = torch.arange(50)
    with torch.no_grad():
        got = est.embed(idx)
        E = est.emb.weight  # naive: each word's vector plus its lexicon attributes', every goal's own tokens
        wv = torch.stack([E[i] + sum((E[sp.words.index(a)] for a in lz.LEXICON.get(w, ())), torch.zeros_like(E[i]))
                          for i, w in enumerate(sp.words)])
        x = wv[est.tokens[idx]]
        objs = x[:, 1:].reshape(50, 5, -1)
        q, k, v = est.qkv(objs).chunk(3, -1)
        a = torch.softmax(torch.einsum("be,bje->bj", q[:, 0], k[:, 1:]) / k.shape[-1] ** 0.5, -1)
        read = torch.einsum("bj,bje->be", a, v[:, 1:])
        ref = est.encoder(torch.cat([x[:, 0], objs[:, 0], read, objs[:, 1:].mean(1)], 1))
    assert torch.allclose(got, ref, atol=1e-6)
    assert est.predict().shape == (len(sp),) and len(list(est.head)) == 3  # Linear(d,128)-tanh-Linear(128,1)


def test_set_space_equals_an_estimator_built_on_the_new_goals(small, held_out):
    sp, cfg = small
    torch.manual_seed(0)
    est = mg.Estimator(sp, cfg)
    fresh = mg.Estimator(held_out, cfg)
    fresh.load_state_dict(est.state_dict())
    est.set_space(held_out)
    assert np.allclose(est.predict(), fresh.predict(), atol=1e-6)


def test_magellan_delay_buffer_and_alp(small):
    sp, cfg = small
    assert cfg.n_snapshots == int(8 / 4 + 1) == 3
    s0 = mg.Magellan(sp, cfg, seed=0)  # θ_0 is in B from the start, as the official sampler pushes it
    assert len(s0.snapshots) == 1 and np.array_equal(s0.snapshots[0][1], s0.estimate)
    res = ms.run(sp, "magellan", cfg, seed=0)
    s = res["sampler"]
    assert len(s.snapshots) == 3
    weights, cached = s.snapshots[0]
    assert np.allclose(s.delayed.predict(), cached, atol=1e-6)  # cached predictions = the delayed model's
    cur = s.model.state_dict()
    assert any(not torch.equal(weights[k], cur[k]) for k in weights)  # a clone, not a reference
    alp = np.abs(s.snapshots[-1][1] - cached)
    assert np.array_equal(s.alp, np.where(alp < cfg.threshold, 0, alp))
    assert res["competence"].shape == (41, 5) and res["sampled"].sum() == 40 * cfg.episodes


def test_magellan_swap_keeps_weights_empties_D_and_rescores_every_snapshot(small, held_out):
    sp, cfg = small
    s = copy.deepcopy(ms.run(sp, "magellan", cfg, seed=0)["sampler"])
    before = {k: v.clone() for k, v in s.model.state_dict().items()}
    s.swap(held_out)
    assert len(s.D_goal) == len(s.D_r) == 0 and s.G == len(held_out)
    assert all(torch.equal(before[k], v) for k, v in s.model.state_dict().items())
    ref = mg.Estimator(held_out, cfg)
    for weights, preds in s.snapshots:  # each snapshot's cached predictions = its weights on the new goals
        ref.load_state_dict(weights)
        assert np.allclose(preds, ref.predict(), atol=1e-6)
    ref.load_state_dict(before)
    assert np.allclose(s.estimate, ref.predict(), atol=1e-6)
    alp = np.abs(s.estimate - s.snapshots[0][1])
    assert np.array_equal(s.alp, np.where(alp < cfg.threshold, 0, alp))


def test_one_hot_swap_gives_new_goals_fresh_rows(small, held_out):
    sp, cfg = small
    cfg1 = mg.Config.for_scale("smoke", "one_hot_goals", n_goals=600, rounds=8, R=4, N=8)
    s = ms.run(sp, "magellan", cfg1, seed=0)["sampler"]
    old = s.model.ids.weight.detach().clone()
    assert s.model.ids.weight in s.opt.state
    s.swap(held_out)
    assert not torch.allclose(old, s.model.ids.weight) and s.model.ids.weight not in s.opt.state


def test_study_swaps_a_copy_and_measures_the_new_goals(small, held_out):
    sp, cfg = small
    out = ms.study.__wrapped__(sp, "online_alp", cfg, 0, None, held_out)
    main, sw = out["main"], out["swap"]
    assert main["competence"].shape == (41, 5) and sw["competence"].shape == (cfg.swap_rounds + 1, 5)
    assert main["sampler"] is not sw["sampler"] and main["sampler"].space is sp
    est, true = sw["at_swap"]
    assert true.shape == (len(held_out),)  # Online-ALP: the new goals' estimates are the inherited buffers' means
    assert np.isfinite(est).any() and (est[held_out.family == 4][np.isfinite(est[held_out.family == 4])] == 0).all()
    assert np.allclose(ms.run(sp, "online_alp", cfg, seed=0)["competence"], main["competence"])
    assert np.allclose(sw["competence"][0], [true[held_out.family == f].mean() for f in range(5)])
    assert sw["competence"][0][1] < main["competence"][-1][1]  # τ < 1: unpractised plant names start lower
    m = ms.study.__wrapped__(sp, "magellan", cfg, 0, None, held_out)["swap"]
    assert ms.mae_at_swap(m) == pytest.approx(np.abs(m["at_swap"][0] - m["at_swap"][1]).mean())


def test_no_delay_gives_zero_alp(small):
    sp, cfg = small
    cfg0 = mg.Config.for_scale("smoke", "no_delay", n_goals=600, rounds=12, R=4)
    assert cfg0.N == 0 and cfg0.n_snapshots == 1
    s = ms.run(sp, "magellan", cfg0, seed=0)["sampler"]
    assert (s.alp == 0).all()


def test_shuffled_alp_keeps_the_values_and_moves_them_across_goals(small):
    sp, cfg = small
    cfgs = mg.Config.for_scale("smoke", "shuffled_alp", n_goals=600, rounds=40, R=4, N=8, fifo=4)
    s = ms.run(sp, "magellan", cfgs, seed=0)["sampler"]
    alp = np.abs(s.estimate - s.snapshots[0][1])
    alp[alp < cfgs.threshold] = 0.0
    assert np.array_equal(np.sort(s.alp), np.sort(alp)) and not np.array_equal(s.alp, alp) and alp.any()


def test_oracle_alp_is_the_true_competence_change_per_goal(small):
    sp, cfg = small
    r = ms.Run(sp, "oracle", cfg, seed=0)
    per_goal = [r.student.competence(sp)]
    for _ in range(cfg.rounds):
        r.step()
        per_goal.append(r.student.competence(sp))
    t = cfg.rounds  # last recompute at round 40 (R divides it)
    alp = np.abs(per_goal[t] - per_goal[t - cfg.N])
    assert np.allclose(r.sampler.alp, np.where(alp < cfg.threshold, 0, alp))
    assert len(np.unique(r.sampler.alp[sp.family == 1])) > 1  # τ < 1: plant goals differ by name


def test_goal_features_take_the_last_real_token():
    from lab.models.tokenizer import word_tokenizer
    from lab.models.zoo import tiny_llama

    sp = lz.make_goal_space(20, 0)
    tok = word_tokenizer(lz.vocabulary())
    torch.manual_seed(0)
    m = tiny_llama(vocab_size=len(tok), d_model=16, n_layers=1, n_heads=2).eval()
    h = mg.goal_features(m, tok, sp, batch=7)
    one = tok(sp.text(3), return_tensors="pt")
    ref = m(**one, output_hidden_states=True).hidden_states[-1][0, -1]
    assert h.shape == (20, 16) and torch.allclose(h[3], ref, atol=1e-5)


def test_widgets_build(small):
    from lab.widgets.magellan import competence_explorer, competence_figure, embedding_figure

    sp, cfg = small
    res = ms.run(sp, "magellan", cfg, seed=0)
    fig = competence_figure({(600, 8): res, (600, 0): res})
    assert len(fig.data) == 16 and len(fig.layout.updatemenus[0].buttons) == 2
    box = competence_explorer({(600, 8): res, (600, 0): res})
    box.controls[1].value = 0
    assert box.key == (600, 0)
    emb = res["sampler"].model.embed(torch.arange(len(sp))).detach().numpy()
    assert len(embedding_figure(emb, sp.family).data) == 5


@pytest.mark.notebook
def test_checkpoint_folder_gives_goal_embeddings(tmp_path):
    """model=<folder>: a saved tiny Llama's hidden states are h(g); MAGELLAN's head runs on them, measured."""
    from lab.models.tokenizer import word_tokenizer
    from lab.models.zoo import tiny_llama

    from ..conftest import run_lab

    tok = word_tokenizer(lz.vocabulary())
    torch.manual_seed(0)
    tiny_llama(vocab_size=len(tok), d_model=24, n_layers=1, n_heads=2).save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    proc = run_lab("run", "10_magellan", "-p", "model", str(tmp_path / "ckpt"), "-p", "n_goals", "1000",
                   "-p", "rounds", "16", "--out", str(tmp_path / "out"), "--no-page")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "10_magellan.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == []
    ck = rec["metrics"]["checkpoint"]
    assert ck["hidden_size"] == 24 and ck["n_goals"] == 1000 and set(ck["final_competence"]) >= {"magellan", "random"}
    assert 0 <= ck["mae_never_sampled"] <= 1


def test_rounds_to_is_the_first_crossing_or_one_past_the_end():
    assert ms.rounds_to(np.array([0.1, 0.5, 0.8, 0.7, 0.9]), 0.8) == 2
    assert ms.rounds_to(np.array([0.1, 0.5, 0.79]), 0.8) == 3
    assert ms.rounds_to(np.array([0.9]), 0.8) == 0


def test_attempts_succeed_at_the_competence_rate():
    sp = lz.make_goal_space(600, seed=0)
    st = lz.Student(eta=0.0, transfer=0.25)  # η = 0: no learning, the rate stays put
    st.s[:] = [0.9, 0.8, 0.7, 0.6]
    h = _goal(sp, 2)
    st.v[sp.target[h]] = 0.2
    r = st.attempt(sp, np.full(20_000, h), np.random.default_rng(0))
    p = 0.9 * 0.8 * (0.25 * 0.7 + 0.75 * 0.2)
    assert st.competence(sp)[h] == pytest.approx(p) and abs(r.mean() - p) < 4 * np.sqrt(p * (1 - p) / 20_000)


def test_mae_never_sampled_by_hand_and_restricted_to_a_mask():
    res = {"times_sampled": np.array([0, 3, 0, 0, 1]), "estimate": np.array([0.5, 0.9, np.nan, 0.1, 0.0]),
           "true": np.array([0.25, 0.0, 1.0, 0.0, 1.0])}
    assert ms.mae_never_sampled(res) == pytest.approx((0.25 + 0.1) / 2)  # goal 2 has no estimate
    assert ms.mae_never_sampled(res, np.array([True, True, True, False, True])) == pytest.approx(0.25)


def test_eval_alp_error_matches_the_binomial_closed_form():
    from scipy.stats import binom

    true, rng = np.array([0.0, 1.0, 0.3, 0.5, 0.9]), np.random.default_rng(0)
    draws = np.stack([ms.eval_alp(true, 4, rng) for _ in range(20_000)])
    assert set(np.unique(draws * 4)) <= {0, 1, 2, 3, 4} and (draws[:, 0] == 0).all() and (draws[:, 1] == 1).all()
    k = np.arange(5)
    closed = (binom.pmf(k[None], 4, true[:, None]) * np.abs(k[None] / 4 - true[:, None])).sum(1)  # E|k/m − p|
    assert np.allclose(np.abs(draws - true).mean(0), closed, atol=0.01)


def test_ek_eval_alp_gives_each_bucket_its_sampled_success_rate(small):
    sp, _ = small
    true = np.where(sp.family == 0, 1.0, 0.0) + np.where(sp.family == 2, np.linspace(0, 1, len(sp)), 0.0)
    est = ms.ek_eval_alp(true, sp.family, 50_000, np.random.default_rng(0))
    for f in range(5):
        assert len(np.unique(est[sp.family == f])) == 1  # one value per bucket
    assert est[sp.family == 0][0] == 1.0 and est[sp.family == 1][0] == 0.0
    assert est[sp.family == 2][0] == pytest.approx(true[sp.family == 2].mean(), abs=0.01)


def test_mae_by_family_and_q1_mae_by_hand():
    fam = np.array([0, 0, 3, 4, 4])
    m = ms.mae_by_family(np.array([0.5, 1.0, 0.2, 0.1, 0.0]), np.array([0.25, 1.0, 0.6, 0.0, 0.0]), fam)
    assert np.isnan(m[1]) and np.isnan(m[2])  # families with no goal here
    assert np.allclose(m[[0, 3, 4, 5]], [0.125, 0.4, 0.05, (0.25 + 0 + 0.4) / 3])
    res = {"q1": {"rounds": np.array([4, 8, 12]), **{k: np.arange(18.0).reshape(3, 6) + i for i, k in
                                                       enumerate(ms.Q1[1:])}}}
    assert ms.q1_mae(res, after=4) == {"magellan": 14.0, "eval_alp": 15.0, "ek_eval_alp": 16.0}  # rounds 8, 12
    assert ms.q1_mae(res, after=4, column=3)["magellan"] == 12.0


def test_q1_evaluators_score_magellans_estimate_and_leave_the_run_alone(small, monkeypatch):
    sp, cfg = small
    r = ms.Run(sp, "magellan", cfg, seed=0)
    for _ in range(cfg.rounds):
        r.step()
    res = r.result()
    q = res["q1"]
    assert list(q["rounds"]) == list(range(cfg.R, cfg.rounds + 1, cfg.R)) and q["eval_alp"].shape == (10, 6)
    last = ms.mae_by_family(r.sampler.model.predict(), r.student.competence(sp), sp.family)  # round 40: a recompute
    assert np.allclose(q["magellan"][-1], last, equal_nan=True)
    monkeypatch.setattr(ms.Run, "evaluate", lambda self, t: None)  # no evaluators: the same learner and estimates
    bare = ms.run(sp, "magellan", cfg, seed=0)
    assert np.allclose(bare["competence"], res["competence"]) and np.allclose(bare["estimate"], res["estimate"])
    assert bare["q1"] is None and ms.run(sp, "online_alp", cfg, seed=0)["q1"] is None
