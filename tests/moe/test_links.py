"""The links: the simulator's time model (FIFO copies, compute lanes) and the host-to-device copy timer."""

import pytest
import torch

from lab.moe.links import MIXTRAL, SimLink, TimeModel, h2d_bandwidth


def test_sim_link_time_model():
    tm = TimeModel(pcie=1e3, hbm=1e4, latency=0.5)
    link = SimLink(tm)
    _, r1 = link.copy(torch.zeros(100, dtype=torch.uint8), 0, "a")  # 0.5 + 0.1
    _, r2 = link.copy(torch.zeros(1000, dtype=torch.uint8), 0, "b")  # FIFO: starts when the first ends
    assert r1 == pytest.approx(0.6) and r2 == pytest.approx(0.6 + 1.5)
    link.compute(0, 10_000, lambda: None)  # overlaps the copies
    assert link.now() == pytest.approx(1.0)
    link.wait(r2)
    assert link.now() == pytest.approx(2.1)
    lanes = [(s.lane, s.start, s.end) for s in link.spans]
    assert lanes[2] == ("compute", 0.0, pytest.approx(1.0))


def test_h2d_bandwidth_runs_on_cpu():
    bw = h2d_bandwidth(H=64, n_rows=(1, 8), device="cpu", reps=2)
    assert set(bw) == {"compact", "per_row"} and all(v > 0 for d in bw.values() for v in d.values())
    assert list(bw["compact"]) == [1, 8]


def test_mixtral_equivalent_scales_both_bandwidths():
    tm = TimeModel.mixtral_equivalent(64, 192, pcie=10.0)
    assert tm.scale == 64 * 192 / (MIXTRAL["H"] * MIXTRAL["F"])
    assert tm.transfer(100) == pytest.approx(tm.latency + 100 / (10.0 * tm.scale))
    assert tm.compute(100) == pytest.approx(100 / (936e9 * tm.scale))
