import math
from dataclasses import FrozenInstanceError, replace

import pytest
import torch
import torch.nn.functional as F

from lab.align import rip as R
from lab.align.train import train_pairs
from lab.data.instructions import KINDS, RESPONSE_LEN, InstructionWorld
from lab.models import TrainConfig, fit, tiny_llama
from lab.models.sample import sample_responses

from ..data.test_instructions import Always


def toy_pool():
    """Rewards of N=4 samples for 6 prompts, hand-made: prompts 0-2 good (high worst reward, small gap),
    3-4 bad (low worst, large gap), 5 degenerate (all equal: no preference)."""
    r = torch.tensor([[0.9, 0.8, 1.0, 0.85],
                      [0.7, 0.9, 0.8, 0.75],
                      [1.0, 0.95, 0.9, 1.0],
                      [0.1, 0.9, 0.5, 0.0],
                      [0.8, 0.05, 0.3, 0.6],
                      [0.5, 0.5, 0.5, 0.5]])
    length = torch.tensor([[6, 6, 6, 6], [6, 5, 6, 6], [6, 6, 4, 6], [2, 6, 6, 1], [6, 0, 3, 6], [6, 6, 3, 6]])
    return r, length


def test_best_vs_worst_metrics_by_hand():
    r, length = toy_pool()
    p = R.best_vs_worst(r, length)
    assert p.w.tolist() == [2, 1, 0, 1, 0, 0] and p.l.tolist() == [1, 0, 2, 3, 1, 3]  # all tied: the last
    torch.testing.assert_close(p.m1, torch.tensor([0.8, 0.7, 0.9, 0.0, 0.05, 0.5]))
    assert p.m2.tolist() == [6, 6, 4, 1, 0, 6]
    torch.testing.assert_close(p.m3, torch.tensor([0.2, 0.2, 0.1, 0.9, 0.75, 0.0]))
    assert p.valid.tolist() == [True] * 5 + [False]


def test_best_vs_bottom_quartile_draws_from_the_lowest_quarter():
    """Table 17's re-pairing: the chosen stays the best; the rejected is one of the ⌊N/4⌋ lowest-reward samples,
    uniformly (all of them seen over many draws, never another), its metrics recomputed from r."""
    r = torch.tensor([[0.9, 0.1, 0.5, 0.2, 0.3, 0.0, 0.8, 0.4], [0.5] * 8])
    length = torch.arange(16.0).view(2, 8)
    base = R.best_vs_worst(r, length)
    g, seen = torch.Generator().manual_seed(0), set()
    for _ in range(50):
        p = R.best_vs_bottom_quartile(base, length, g)
        assert p.w.tolist() == base.w.tolist() and int(p.l[0]) in (5, 1)  # rewards 0.0 and 0.1: the 2 lowest of 8
        seen.add(int(p.l[0]))
        torch.testing.assert_close(p.m1, r[[0, 1], p.l])
        assert p.m2.tolist() == length[[0, 1], p.l].tolist() and p.valid.tolist() == [True, False]
        assert int(p.l[1]) in (0, 1)  # all tied: the first two in generation order
    assert seen == {1, 5}


def lumiopen_pair(rewards: list[float]) -> tuple[int, int]:
    """The public re-implementation's choice (LumiOpen/rip): sort the samples by score, descending, with
    Python's stable sort; best = the head, worst = the tail."""
    order = sorted(range(len(rewards)), key=lambda i: rewards[i], reverse=True)
    return order[0], order[-1]


def test_ties_are_broken_as_the_public_reimplementation_not_by_length():
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 7, (500, 8), generator=g).float() / 6  # rewards in steps of 1/6: many ties
    length = torch.randint(0, 8, (500, 8), generator=g)
    p = R.best_vs_worst(r, length)
    want = [lumiopen_pair(row) for row in r.tolist()]
    assert p.w.tolist() == [a for a, _ in want] and p.l.tolist() == [b for _, b in want]
    # the old rule (shortest among the worst) would bias m2 downwards; this one is length-blind
    shortest = (r * (length.max() + 1) + length).argmin(1)
    assert (shortest != p.l).any()


def test_thresholds_over_the_valid_pool_and_the_conjunction():
    r, length = toy_pool()
    p = R.best_vs_worst(r, length)
    tau = R.thresholds(p)  # medians over the 5 valid prompts only (the degenerate one is excluded)
    assert tau == pytest.approx((0.7, 4.0, 0.2))
    keep = R.keep(p, tau)
    assert keep.tolist() == [True, True, True, False, False, False]
    # percentiles come from the whole pool once: filtering a subset with the pool's tau gives the same answer
    sub = R.Pool(*(getattr(p, f)[:3] for f in ("w", "l", "chosen_reward", "m1", "m2", "m3", "valid")))
    assert R.keep(sub, tau).all()
    with pytest.raises(ValueError, match="no valid pair"):
        R.thresholds(R.Pool(*(getattr(p, f)[5:] for f in ("w", "l", "chosen_reward", "m1", "m2", "m3", "valid"))))


def test_wrong_variants_keep_the_bad_prompts():
    """The filter's direction: keeping large gaps, or filtering on the chosen side, lets bad prompts in."""
    r, length = toy_pool()
    p = R.best_vs_worst(r, length)
    bad = torch.tensor([False, False, False, True, True, False])
    assert R.bad_fraction(R.keep(p, R.thresholds(p)), bad) == 0.0
    single = R.single_filters(p)
    assert R.bad_fraction(single["large gap"], bad) == 1.0  # the gap direction flipped
    assert R.bad_fraction(single["chosen reward only"], bad) > 0  # chosen instead of rejected


def test_random_subset_has_the_size_and_stays_valid():
    valid = torch.tensor([True, False, True, True, False, True])
    sub = R.random_subset(valid, 3, torch.Generator().manual_seed(0))
    assert sub.sum() == 3 and not (sub & ~valid).any()
    assert math.isnan(R.bad_fraction(torch.zeros(6, dtype=torch.bool), valid))


def test_the_random_filter_control_keeps_rips_size_at_random():
    r, length = toy_pool()
    p = R.best_vs_worst(r, length)
    tau = R.thresholds(p)
    assert R.rip_filter(p, tau).tolist() == R.keep(p, tau).tolist()
    sizes, hit_bad = set(), False
    for s in range(20):
        m = R.rip_filter(p, tau, "random_filter", torch.Generator().manual_seed(s))
        sizes.add(int(m.sum()))
        assert not (m & ~p.valid).any()
        hit_bad |= bool(m[3:5].any())
    assert sizes == {3} and hit_bad  # same size as RIP's set, and it lets bad prompts in
    with pytest.raises(ValueError, match="not a control"):
        R.rip_filter(p, tau, "nope")


def test_the_chosen_metrics_control_by_hand():
    """m1 = r_w, m2 = |y_w| at their own medians; the gap rule and its threshold stay RIP's."""
    r, length = toy_pool()
    p = R.best_vs_worst(r, length)
    # valid rows 0-4: r_w = 1.0, 0.9, 1.0, 0.9, 0.8 (median 0.9); |y_w| = 6, 5, 6, 6, 6 (median 6); gap median 0.2
    assert R.thresholds(p, control="chosen_metrics") == pytest.approx((0.9, 6.0, 0.2))
    tau = R.thresholds(p, control="chosen_metrics")
    assert R.rip_filter(p, tau, "chosen_metrics").tolist() == [True, False, True, False, False, False]
    assert R.thresholds(p, control="large_gap") == R.thresholds(p, control="random_filter") == R.thresholds(p)


def reference_pool(r: torch.Tensor, length: torch.Tensor) -> list[dict]:
    """Per prompt, in plain Python: the LumiOpen/rip pair and both sides' reward and length."""
    rows = []
    for rr, ll in zip(r.tolist(), length.tolist()):
        w, l = lumiopen_pair(rr)
        rows.append({"rw": rr[w], "rl": rr[l], "lw": ll[w], "ll": ll[l], "gap": rr[w] - rr[l], "valid": rr[w] > rr[l]})
    return rows


@pytest.mark.parametrize("control", ["", "chosen_metrics", "large_gap"])
def test_controls_against_a_per_prompt_reference(control):
    """RIP and its two wrong variants (the paper card's), each against numpy quantiles and a per-prompt loop:
    `chosen_metrics` reads the chosen side's reward and length, `large_gap` keeps gaps above τ3; nothing else moves."""
    import numpy as np

    g = torch.Generator().manual_seed(1)
    r = torch.randint(0, 7, (400, 8), generator=g).float() / 6
    length = torch.randint(0, 8, (400, 8), generator=g)
    rows = reference_pool(r, length)
    side = ("rw", "lw") if control == "chosen_metrics" else ("rl", "ll")
    vals = {k: np.array([row[k] for row in rows if row["valid"]], dtype=np.float64) for k in (*side, "gap")}
    t1, t2, t3 = (np.quantile(vals[k], 0.5) for k in (*side, "gap"))
    want = [row["valid"] and row[side[0]] >= t1 - 1e-6 and row[side[1]] >= t2
            and (row["gap"] > t3 + 1e-6 if control == "large_gap" else row["gap"] <= t3 + 1e-6) for row in rows]
    p = R.best_vs_worst(r, length)
    tau = R.thresholds(p, control=control)
    assert tau == pytest.approx((t1, t2, t3), abs=1e-6)
    got = R.rip_filter(p, tau, control)
    assert got.tolist() == want and 0 < int(got.sum()) < int(p.valid.sum())


@pytest.mark.parametrize("control", ["random_filter", "chosen_metrics", "large_gap"])
def test_a_control_changes_only_rips_row(control):
    """Under a control, Table 7's rows other than RIP (and the random subset of its size) are the method's."""
    g = torch.Generator().manual_seed(2)
    r = torch.randint(0, 7, (300, 8), generator=g).float() / 6
    p = R.best_vs_worst(r, torch.randint(0, 8, (300, 8), generator=g))
    base = R.filter_sets(p, R.thresholds(p), 0.5, "", torch.Generator().manual_seed(0))
    ctl = R.filter_sets(p, R.thresholds(p, control=control), 0.5, control, torch.Generator().manual_seed(0))
    assert list(ctl) == list(base)
    assert ctl["RIP"].tolist() != base["RIP"].tolist()
    for name in set(base) - {"RIP", "random, RIP's size"}:
        assert ctl[name].tolist() == base[name].tolist(), name


# ------------------------------------------------------------------------------ the toy's protocol

WORLD = InstructionWorld()


def test_config_lists_the_sizes_of_each_scale():
    smoke, full = R.Config.for_scale("smoke"), R.Config.for_scale("full", "random_filter")
    assert all(R.Config.for_scale("smoke", c) == smoke for c in R.CONTROLS)
    assert (smoke.n_pool, smoke.n_samples, smoke.n_eval, smoke.n_fresh, smoke.dpo_epochs) == (800, 8, 400, 400, 2.0)
    assert (full.n_pool, full.n_samples, full.n_eval, full.n_fresh, full.dpo_epochs) == (3000, 16, 1000, 1500, 3.0)
    assert (smoke.dpo_beta, smoke.dpo_lr, smoke.dpo_batch, smoke.fresh_bad_frac) == (0.1, 1e-4, 32, 0.3)
    with pytest.raises(FrozenInstanceError):
        smoke.n_pool = 1
    with pytest.raises(ValueError, match="not a control"):
        R.Config.for_scale("smoke", "nope")


def test_dpo_loss_is_dpo_on_the_summed_token_log_probs():
    g = torch.Generator().manual_seed(0)
    b = {k: -3 * torch.rand(3, 4, generator=g) for k in ("pi_w", "ref_w", "pi_l", "ref_l")}
    want = sum(-math.log(1 / (1 + math.exp(-0.1 * ((b["pi_w"][i].sum() - b["ref_w"][i].sum())
                                                    - (b["pi_l"][i].sum() - b["ref_l"][i].sum())).item())))
               for i in range(3)) / 3
    assert R.dpo_loss(b, beta=0.1).item() == pytest.approx(want, abs=1e-6)


def test_removed_by_kind_by_hand():
    kind = torch.tensor([0, 0, 1, 1, 1, 2, 3])
    valid = torch.tensor([True, True, True, True, False, True, False])
    kept = torch.tensor([True, False, False, False, False, True, False])
    # clean: 1 of 2 valid kept; garbled: 0 of 2 valid kept; mislabeled: 1 of 1 kept; truncated: no valid pair
    assert R.removed_by_kind(kept, valid, kind, KINDS) == {"clean": 0.5, "garbled": 1.0, "mislabeled": 0.0,
                                                          "truncated": 1.0}


def test_filter_sets_are_table_7s_rows_drawn_in_order():
    r, length = toy_pool()
    p = R.best_vs_worst(r, length)
    tau = R.thresholds(p)
    sets = R.filter_sets(p, tau, 0.5, "", torch.Generator().manual_seed(3))
    assert list(sets)[:3] == ["full (valid pairs)", "RIP", "random, RIP's size"]
    assert sets["full (valid pairs)"] is p.valid and sets["RIP"].tolist() == R.keep(p, tau).tolist()
    g = torch.Generator().manual_seed(3)
    assert sets["random, RIP's size"].tolist() == R.random_subset(p.valid, 3, g).tolist()
    assert all(sets[k].tolist() == v.tolist() for k, v in R.single_filters(p, 0.5).items())
    # RIP without m2 (median m1 0.7, median gap 0.2) and RIP on the chosen side (by hand above)
    assert sets["RIP without m2"].tolist() == [True, True, True, False, False, False]
    assert sets["RIP on the chosen side"].tolist() == [True, False, True, False, False, False]
    # the control draws its subset first, then the equal-size random row
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    ctl = R.filter_sets(p, tau, 0.5, "random_filter", g1)
    first = R.random_subset(p.valid, 3, g2)
    assert ctl["RIP"].tolist() == first.tolist()
    assert ctl["random, RIP's size"].tolist() == R.random_subset(p.valid, 3, g2).tolist()


def test_make_pool_samples_judges_and_pairs_best_with_worst():
    model = Always(WORLD.tokenizer.convert_tokens_to_ids("0"))
    p, Y, pool = R.make_pool(WORLD, model, 30, 0.5, 3, generator=torch.Generator().manual_seed(0))
    assert Y.shape == (30, 3, RESPONSE_LEN) and (Y == WORLD.tokenizer.convert_tokens_to_ids("0")).all()
    g = torch.Generator().manual_seed(0)  # the same draws, in the same order, by hand
    p2 = WORLD.prompts(30, g, bad_frac=0.5)
    sample_responses(model, p2["prompt"], 3, RESPONSE_LEN, generator=g, temperature=1.0)
    r = WORLD.reward(p2, Y, g)
    assert torch.equal(p["prompt"], p2["prompt"])
    for i in range(30):  # all responses are 7 digits long, no <eos>: the reward alone ranks them
        lo, hi = min(r[i].tolist()), max(r[i].tolist())
        assert (pool.m1[i].item(), pool.chosen_reward[i].item(), pool.m2[i].item()) == (lo, hi, 7)
        assert pool.m3[i].item() == pytest.approx(hi - lo) and bool(pool.valid[i]) == (hi > lo)


def test_subset_pairs_take_the_best_and_worst_rows_of_the_mask():
    g = torch.Generator().manual_seed(1)
    p = WORLD.prompts(5, g)
    Y = torch.randint(len(WORLD.tokenizer), (5, 3, RESPONSE_LEN), generator=g)
    pool = R.Pool(torch.tensor([0, 1, 2, 0, 1]), torch.tensor([2, 0, 1, 1, 2]), *[torch.zeros(5)] * 4,
                  torch.ones(5, dtype=torch.bool))
    mask = torch.tensor([True, False, True, True, False])
    pairs = R.subset_pairs(WORLD, p, Y, pool, mask)
    rows = [0, 2, 3]
    assert pairs["prompt"].tolist() == [p["prompt"][i].tolist() for i in rows]
    assert pairs["chosen"].tolist() == [Y[i, int(pool.w[i])].tolist() for i in rows]
    assert pairs["rejected"].tolist() == [Y[i, int(pool.l[i])].tolist() for i in rows]
    assert torch.equal(pairs["rejected_mask"], WORLD.response_mask(pairs["rejected"]))


def test_self_rip_post_filter_applies_the_first_pools_thresholds_to_a_fresh_pool():
    model = Always(WORLD.eos)  # answers <eos> at once: only truncated prompts get reward
    cfg = replace(R.Config(), n_fresh=60, n_samples=4)
    tau = (0.0, 0.0, 1.0)
    out = R.self_rip_post_filter(WORLD, model, tau, cfg, generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(2)
    p, _, pool = R.make_pool(WORLD, model, 60, cfg.fresh_bad_frac, 4, generator=g)
    kept = R.keep(pool, tau)
    assert out == {"pool": R.bad_fraction(pool.valid, p["kind"] > 0), "kept": R.bad_fraction(kept, p["kind"] > 0),
                   "size": int(kept.sum())}


def test_seed_model_is_the_tiny_llama_fit_on_the_world():
    cfg = replace(R.Config(), base=replace(R.Config.base, steps=3))
    run = R.seed_model(WORLD, cfg, seed=0, device="cpu")
    ref = fit(lambda: tiny_llama(vocab_size=len(WORLD.tokenizer), d_model=64, n_layers=2, n_heads=4, max_len=20), WORLD,
              TrainConfig(steps=3, batch_size=64, lr=3e-3, seed=0), cache=False)
    assert run.key == ref.key
    assert all(torch.equal(a, b) for a, b in zip(run.model.parameters(), ref.model.parameters()))


@pytest.mark.parametrize("loss, fixed", [("dpo", None), ("rpo", None), ("dpo", 5)])
def test_dpo_on_subsets_is_train_pairs_for_equal_epochs_then_the_clean_reward(loss, fixed):
    """Equal epochs by default (steps ∝ the subset's size); `steps` gives every subset the same number."""
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(WORLD.tokenizer), d_model=16, n_layers=1, n_heads=2, max_len=20).eval()
    g = torch.Generator().manual_seed(5)
    p, Y, pool = R.make_pool(WORLD, model, 24, 0.3, 3, generator=g)
    evalp = WORLD.prompts(10, g, bad_frac=0.0)
    cfg = replace(R.Config(), dpo_epochs=1.0, dpo_batch=4, eval_samples=2)
    subsets = {"a": pool.valid, "b": pool.valid & (torch.arange(24) % 2 == 0)}
    got = R.dpo_on_subsets(WORLD, model, p, Y, pool, subsets, cfg, seed=1, eval_prompts=evalp,
                           generator=torch.Generator().manual_seed(9), loss=loss, steps=fixed)

    def by_hand(b):  # the loss as written out by hand; RPO adds the chosen response's per-token NLL
        h = (b["pi_w"].sum(-1) - b["ref_w"].sum(-1)) - (b["pi_l"].sum(-1) - b["ref_l"].sum(-1))
        nll = -b["pi_w"].sum(-1) / b["chosen_mask"].sum(-1) if loss == "rpo" else 0.0
        return (-F.logsigmoid(0.1 * h) + nll).mean()

    g = torch.Generator().manual_seed(9)
    for name, m in subsets.items():
        pairs = R.subset_pairs(WORLD, p, Y, pool, m)
        pairs["chosen_mask_"] = pairs["chosen_mask"]  # an extra, so the hand-written loss sees it per batch
        steps = fixed or max(1, round(int(m.sum()) / 4))  # one epoch: as many steps as batches of 4 in the subset
        assert R.epoch_steps(cfg, m) == max(1, round(int(m.sum()) / 4))
        policy, _ = train_pairs(model, pairs, lambda b: by_hand({**b, "chosen_mask": b["chosen_mask_"]}),
                                steps=steps, lr=1e-4, batch_size=4, seed=1, quiet=True)
        want = WORLD.model_reward(policy, evalp, g, samples=2)
        assert got[name] == pytest.approx(want, abs=1e-6), name


def test_jaccard_by_hand():
    assert R.jaccard(torch.tensor([1, 2, 3]), torch.tensor([3, 2, 2, 9])) == pytest.approx(2 / 4)
    assert R.jaccard(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)) == 1.0


def test_cheap_filters_against_a_per_example_loop():
    """IFD = s(A|Q)/s(A) and ppl(chosen) by explicit per-example cross-entropies, kept from the 25th percentile;
    the prompt-only judge drops exactly the truncated prompts; the overlap filter keeps the high-overlap pairs."""
    world = InstructionWorld(bad_frac=0.6)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=len(world.tokenizer), d_model=16, n_layers=1, n_heads=2, max_len=20).eval()
    p = world.prompts(40, g)
    Y = sample_responses(model, p["prompt"], 4, RESPONSE_LEN, generator=g, temperature=1.0)
    pool = R.best_vs_worst(world.reward(p, Y, g), world.length(Y))
    got = R.cheap_filters(world, model, p, Y, pool, 0.5)

    def s(context, y):  # mean NLL of y's tokens up to and including <eos>, one example at a time
        n = int(world.response_mask(y).sum())
        logits = model(input_ids=torch.cat([context, y])[None]).logits[0]
        return F.cross_entropy(logits[len(context) - 1:len(context) - 1 + n], y[:n]).item()

    with torch.no_grad():
        yw = Y[torch.arange(40), pool.w]
        with_q = torch.tensor([s(p["prompt"][i], yw[i]) for i in range(40)])
        alone = torch.tensor([s(p["prompt"][i, :1], yw[i]) for i in range(40)])
    v = pool.valid
    ifd, ppl = with_q / alone, with_q.exp()
    assert got["IFD (25–100 %)"].tolist() == (v & (ifd >= torch.quantile(ifd[v], 0.25))).tolist()
    assert got["ppl(chosen) (25–100 %)"].tolist() == (v & (ppl >= torch.quantile(ppl[v], 0.25))).tolist()
    assert got["prompt-only judge"].tolist() == (v & (p["kind"] != 3)).tolist()
    overlap = []
    for i in range(40):  # Jaccard of the token sets of the chosen and rejected responses, up to their <eos>
        a, b = Y[i, pool.w[i]], Y[i, pool.l[i]]
        overlap.append(R.jaccard(a[:int(world.response_mask(a).sum())], b[:int(world.response_mask(b).sum())]))
    overlap = torch.tensor(overlap)
    want = v & (overlap >= torch.quantile(overlap[v], 0.5))  # keeps the high-overlap half: drops low overlap
    assert got["chosen–rejected overlap"].tolist() == want.tolist() and 0 < want.sum() < v.sum()
