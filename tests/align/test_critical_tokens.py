"""cDPO's rollout ground truth (critical tokens, replacement, the rollout study) and CE's agreement with it,
against deterministic stub models whose answers are known by hand."""

import pytest
import torch

from lab.align import cdpo as C
from lab.align import critical_tokens as CT

from .stubs import always


def test_critical_token_rule():
    c = torch.tensor([[0.8, 0.5, 0.0, 0.0, 0.0],  # first zero with nothing after it -> 2
                      [0.3, 0.0, 0.10, 0.0, 0.0],  # a later prefix recovers 10% > 5%: reset -> 3
                      [0.3, 0.0, 0.04, 0.0, 0.0],  # 4% < 5%: still 1
                      [0.9, 0.9, 0.9, 0.9, 0.9]])  # never zero -> -1
    assert CT.critical_token(c).tolist() == [2, 3, 1, -1]


def test_rollouts_and_replacement_with_a_deterministic_model():
    model = always(5)
    y = torch.tensor([[5, 5, 3, 5], [5, 5, 5, 5]])
    prompts = torch.tensor([[1, 2], [1, 2]])
    grade = lambda rows, r: (r == 5).all(-1)  # correct = all fives
    g = torch.Generator().manual_seed(0)
    c = CT.rollout_correctness(model, prompts, y, grade, K=4, generator=g, temperature=0)
    assert c.tolist() == [[1, 1, 0], [1, 1, 1]]  # proper prefixes only: no column for the full trajectory
    assert CT.critical_token(c).tolist() == [2, -1]
    kept, swapped = CT.replacement(model, prompts[:1], y[:1], torch.tensor([2]), grade, K=4, generator=g)
    assert not kept.any() and swapped.all()  # banning the 3 leaves the model's 5, and all rollouts recover
    kept, swapped = CT.replacement(model, prompts[:1], y[:1], torch.tensor([1]), grade, K=4, generator=g)
    assert not swapped.any()  # banning a correct 5 forces a mistake


def test_a_wrong_last_token_alone_gives_no_critical_token():
    """The full trajectory is not its own rollout: y = 5 5 5 3 is wrong only by its last token, every proper prefix
    rolls out to all fives (correct), so no critical token exists. Grading y itself at t = L − 1 (c = 0 there)
    would always find one, at the last position."""
    y, x = torch.tensor([[5, 5, 5, 3]]), torch.tensor([[1, 2]])
    grade = lambda rows, r: (r == 5).all(-1)
    c = CT.rollout_correctness(always(5), x, y, grade, K=4, generator=torch.Generator().manual_seed(0))
    assert c.tolist() == [[1, 1, 1]] and CT.critical_token(c).tolist() == [-1]
    st = CT.rollout_study(always(5), x, y, grade, K=4, operations=(0, 2), generator=torch.Generator().manual_seed(0))
    assert st.found.tolist() == [False] and st.on_operation == 0.0 and st.positions == [0, 0, 0, 0]


def test_rollout_study_by_hand():
    """`always(5)`, correct = all fives: row 0 turns wrong at its 3 (position 2), row 1 never does."""
    model, grade = always(5), lambda rows, r: (r == 5).all(-1)
    y, x = torch.tensor([[5, 5, 3, 5], [5, 5, 5, 5]]), torch.tensor([[1, 2], [1, 2]])
    st = CT.rollout_study(model, x, y, grade, K=4, operations=(0, 2), generator=torch.Generator().manual_seed(0))
    assert st.c.tolist() == [[1, 1, 0], [1, 1, 1]] and st.critical.tolist() == [2, -1]
    assert st.found.tolist() == [True, False] and st.ks == [1, 2, 4] and st.positions == [0, 0, 1, 0]
    assert st.pass_k == {"critical token kept": [0.0, 0.0, 0.0], "critical token replaced": [1.0, 1.0, 1.0]}
    assert st.on_operation == 0.5  # of both trajectories: row 1 has no critical token
    other = CT.rollout_study(model, x, y, grade, K=4, operations=(0, 1), generator=torch.Generator().manual_seed(0))
    assert other.on_operation == 0.0
    rnd = CT.rollout_study(model, x, y, grade, K=4, operations=(0, 2), control="random_token",
                          generator=torch.Generator().manual_seed(0))
    assert rnd.found.all() and rnd.c.tolist() == st.c.tolist()  # a position for every row, the same c_t


def test_ce_agreement_by_hand():
    """P_p writes 5, P_n writes 7: argmin s_t is the 7 of each rejected trajectory; with them swapped (or β's sign
    flipped) it is the first 5. Row 3 has no critical token and does not count."""
    y = torch.tensor([[5, 7, 5], [5, 5, 7], [7, 5, 5], [5, 5, 5]])
    chosen = torch.tensor([[5, 5, 5], [5, 7, 7], [5, 5, 5], [5, 5, 5]])  # row 1 leaves the chosen at 1, not 2
    x = torch.ones(4, 1, dtype=torch.long)
    s = C.ce_scores(always(5), always(7), x, y)
    study = CT.Rollouts(torch.zeros(4, 2), torch.tensor([1, 2, 0, 2]), torch.tensor([True, True, True, False]), [1], {},
                       [], 0.0)
    got = CT.ce_agreement(always(5), always(7), s, x, y, chosen, study, beta=1.0)
    # P_p alone puts probability ~0 on every 7: its argmin is the 7 too
    assert got == {"CE (β = 1)": 1.0, "P_p alone (β = 0)": 1.0, "β sign flipped": 0.0, "P_p / P_n swapped": 0.0,
                   "first differing non-wording token": pytest.approx(2 / 3)}
    assert list(got) == ["CE (β = 1)", "P_p alone (β = 0)", "β sign flipped", "P_p / P_n swapped",
                         "first differing non-wording token"]
    # a free (wording) token 9 at position 0 where the trajectories part: skipped, the heuristic finds the 7 again
    yw, cw = torch.cat([torch.full((4, 1), 9), y], 1), torch.cat([torch.full((4, 1), 8), chosen], 1)
    sw = CT.Rollouts(torch.zeros(4, 3), study.critical + 1, study.found, [1], {}, [], 0.0)
    hits = lambda free: CT.ce_agreement(always(5), always(7), C.ce_scores(always(5), always(7), x, yw), x, yw, cw, sw,
                                        beta=1.0, free=free)["first differing non-wording token"]
    assert hits(None) == 0.0 and hits(torch.tensor([8, 9])) == pytest.approx(2 / 3)


def test_critical_focus_by_hand():
    """Mean over trajectories with a critical token of drop[t*] − mean of the other positions' drops."""
    drop = torch.tensor([[3.0, 1.0, 2.0], [0.0, 0.0, 6.0], [9.0, 9.0, 9.0]])
    study = CT.Rollouts(torch.zeros(3, 2), torch.tensor([0, 2, -1]), torch.tensor([True, True, False]), [1], {}, [],
                        0.0)
    assert CT.critical_focus(drop, study) == pytest.approx(((3 - 1.5) + (6 - 0)) / 2)
