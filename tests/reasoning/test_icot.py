"""iCoT (`lab.reasoning.icot`): the removal-smoothing distribution, the left-deletion schedule by hand, the mask."""

import math

import pytest
import torch

from lab.data.automaton import Automaton
from lab.models.train import task_spec
from lab.reasoning import icot
from lab.reasoning import latent_tokens as lt


def test_removal_offsets_are_the_official_truncated_geometric():
    p = icot.removal_offsets(4.0)
    assert len(p) == 100 and p.sum().item() == pytest.approx(1.0)
    assert p[0].item() == pytest.approx(1 - math.exp(-4)) and p[1].item() == pytest.approx(p[0].item() * math.exp(-4))
    delta = icot.removal_offsets(float("inf"))
    assert delta[0] == 1 and delta[1:].sum() == 0


def _by_hand(task, n, seed, removed):
    ex = task.sample(n, torch.Generator().manual_seed(seed))
    P, C, S = task.encode(ex)
    return [torch.cat([P[i], C[i, min(removed, C.shape[1]):], S[i]]) for i in range(n)], P.shape[1]


def test_schedule_deletes_cot_from_the_left_until_none_is_left():
    task = Automaton(n_states=4, n_actions=4, n_steps=5)
    it = icot.ICoTTask(task, steps=40, remove_frac=0.75, lam=float("inf"), pad=task.ids["<pad>"])
    n_cot = 4 * task.n_steps
    assert [it.scheduled(t, n_cot) for t in (0, 15, 29, 30, 40)] == [0, 10, 19, 20, 26]
    for t in (0, 15, 30):
        object.__setattr__(it, "t", t)
        b = it.batch(6, torch.Generator().manual_seed(t))
        want, lp = _by_hand(task, 6, t, it.scheduled(t, n_cot))
        assert it.t == t + 1
        for i in range(6):
            row = b["input_ids"][i][: len(want[i])]
            assert torch.equal(row, want[i]) and (b["input_ids"][i][len(want[i]):] == it.pad).all()
        assert (b["labels"][:, :lp] == -100).all() and (b["labels"][b["input_ids"] == it.pad] == -100).all()
    assert b["input_ids"].shape[1] == lp + 3  # all of C removed: P ⊕ S


def test_first_batch_is_cot_data_and_the_step_count_is_not_in_the_cache_key():
    cfg = lt.Config()
    v = lt.vocab_of(cfg)
    it = icot.ICoTTask(cfg.task, steps=100, lam=float("inf"), pad=v.pad)
    cot = lt.TraceTask.of(cfg, "cot").batch(8, torch.Generator().manual_seed(3))
    assert torch.equal(it.batch(8, torch.Generator().manual_seed(3))["input_ids"], cot["input_ids"])
    assert "t" not in task_spec(it) and task_spec(it) == task_spec(icot.ICoTTask(cfg.task, steps=100,
                                                                                  lam=float("inf"), pad=v.pad))
    smooth = icot.ICoTTask(cfg.task, steps=100, lam=0.5, pad=v.pad)  # offsets: some rows lose tokens at t = 0
    lens = (smooth.batch(64, torch.Generator().manual_seed(0))["input_ids"] != v.pad).sum(1)
    assert lens.max() == cot["input_ids"].shape[1] and lens.min() < lens.max()
