import math

import pytest
import torch

from lab.align import rip as R


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
    assert p.w.tolist()[:5] == [2, 1, 0, 1, 0] and p.l.tolist() == [1, 0, 2, 3, 1, 2]  # tie at 0.5: the shortest
    torch.testing.assert_close(p.m1, torch.tensor([0.8, 0.7, 0.9, 0.0, 0.05, 0.5]))
    assert p.m2.tolist() == [6, 6, 4, 1, 0, 3]
    torch.testing.assert_close(p.m3, torch.tensor([0.2, 0.2, 0.1, 0.9, 0.75, 0.0]))
    assert p.valid.tolist() == [True] * 5 + [False]


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
    with pytest.raises(ValueError, match="unknown control"):
        R.rip_filter(p, tau, "nope")
