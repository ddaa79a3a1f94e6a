import math

import pytest
import torch

from lab.widgets.policies import (
    distance_figure,
    kl_to_star,
    lm_distance_figure,
    policy_explorer,
    policy_figure,
    trajectory_figure,
)

STAR = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
REF = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
LOG_LAMS = [-1.0, 0.0, 1.0]
SOL = torch.stack([STAR, (STAR + REF) / 2, REF])  # (L, K)
GRID = {"bad": {"pi_ref": REF, "pi_star": STAR, "solutions": {"expo": SOL, "dpo": SOL.flip(0)}}}


def test_kl_to_star():
    d = kl_to_star(STAR, SOL)
    assert d[0] == 0 and d[2] == float((STAR * (STAR / REF).log()).sum())


def test_explorer_slider_updates_the_distances():
    box = policy_explorer(GRID, LOG_LAMS)
    assert "bad/expo 0.0000" in box.readout.value and "log λ = -1" in box.readout.value
    box.lam.value = 2
    d = 0.6 * math.log(0.6 / 0.4) + 0.3 * math.log(0.3 / 0.4) + 0.1 * math.log(0.1 / 0.2)  # KL(π* ‖ π_ref) by hand
    assert f"bad/expo {d:.4f}" in box.readout.value and "bad/dpo 0.0000" in box.readout.value
    assert "KL(π*‖π_θ)" in box.panels["bad"].value


def test_figures():
    fig = policy_figure(GRID, LOG_LAMS)
    per_step = 4  # π*, π_ref, expo, dpo for one context
    assert len(fig.data) == per_step * len(LOG_LAMS)
    vis = fig.layout.sliders[0].steps[1].args[0]["visible"]
    assert vis == [per_step <= i < 2 * per_step for i in range(len(fig.data))]
    expo_at_1 = [t for t, v in zip(fig.data, vis) if v and t.name == "expo"][0]
    torch.testing.assert_close(torch.tensor(expo_at_1.y, dtype=torch.float64), SOL[1])
    dist = distance_figure(GRID, LOG_LAMS)
    assert len(dist.data) == 2 and list(dist.data[0].x) == LOG_LAMS


def test_trajectory_figure():
    traj = torch.stack([REF, (STAR + REF) / 2, STAR])  # (S, K)
    fig = trajectory_figure({"dpo": (REF, traj.flip(-1)), "expo": (STAR, traj)}, STAR, every=25)
    assert [t.name for t in fig.data] == ["dpo: π(y0)", "dpo: π(y1)", "dpo: π(y2)", "expo: π(y0)", "expo: π(y1)",
                                          "expo: π(y2)"]
    assert list(fig.data[3].y) == traj[:, 0].tolist() and list(fig.data[0].y) == traj[:, 2].tolist()
    assert fig.data[0].line.dash == "dot" and fig.data[3].line.dash == "solid"
    assert [s.y0 for s in fig.layout.shapes] == STAR.tolist() and fig.layout.xaxis.title.text == "step / 25"


def test_lm_distance_figure():
    d = {("dpo", 0.1): torch.tensor([0.5, 2.0]), ("dpo", 1.0): torch.tensor([0.3, 1.0]),
         ("expo", 0.1): torch.tensor([0.01, 0.2]), ("expo", 1.0): torch.tensor([0.02, 0.6])}
    fig = lm_distance_figure(d, ("good", "bad"))
    assert [t.name for t in fig.data] == ["dpo (good)", "dpo (bad)", "expo (good)", "expo (bad)"]
    assert list(fig.data[1].x) == [0.1, 1.0] and list(fig.data[1].y) == [2.0, 1.0]
    assert list(fig.data[2].y) == pytest.approx([0.01, 0.02])
    assert fig.data[0].line.dash == "dot" and fig.data[1].line.dash == "solid" and fig.layout.xaxis.type == "log"
