"""The links: the simulator's time model (FIFO copies, compute lanes) and the host-to-device copy timer."""

import pytest
import torch

from lab.moe.links import MIXTRAL, SimLink, TimeModel, h2d_bandwidth


def test_sim_link_time_model():
    tm = TimeModel(pcie=1e3, hbm=1e4, latency=0.5)
    link = SimLink(tm)
    z = lambda n: torch.zeros(n, dtype=torch.uint8)
    r1 = link.copy(z(100), z(100), 0, "a")  # 0.5 + 0.1
    r2 = link.copy(z(1000), z(1000), 0, "b")  # FIFO: starts when the first ends
    assert r1 == pytest.approx(0.6) and r2 == pytest.approx(0.6 + 1.5)
    link.compute(0, 10_000, lambda: None)  # overlaps the copies
    assert link.mark() == pytest.approx(1.0)
    link.wait(r2)
    assert link.mark() == pytest.approx(2.1)
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


def test_sim_link_lanes_and_dependencies():
    """A gather waits for its prediction and occupies the host lane; its copy waits for the gather and for the
    last reader of its destination; every span records what it needed."""
    link = SimLink(TimeModel(pcie=1e3, hbm=1e4, host=2e3, latency=0.0))
    link.compute(0, 10_000, lambda: None, "predict")  # ends at 1.0
    staged, g = link.gather(torch.arange(20, dtype=torch.uint8).reshape(10, 2), torch.tensor([1, 3]), 1, "gather",
                            link.mark())
    assert torch.equal(staged, torch.tensor([[2, 3], [6, 7]], dtype=torch.uint8)) and g == pytest.approx(1.002)
    dst = torch.zeros(2, 2, dtype=torch.uint8)
    r = link.copy(staged, dst, 1, "rows", (g, 1.5))  # the destination is read until 1.5
    assert torch.equal(dst, staged) and r == pytest.approx(1.504)
    assert [(s.lane, s.needs) for s in link.spans] == [("compute", 0.0), ("host", 1.0), ("transfer", 1.5)]
    link.wait(None)
    assert link.mark() == 1.0 and link.elapsed(0.5, 2.0) == 1.5


def test_gather_bandwidth_runs():
    from lab.moe.links import gather_bandwidth

    assert gather_bandwidth(H=64, F=256, reps=2) > 0


def _causal(spans):
    """Check a decode's span list: every span starts once its inputs exist; each prediction of layer n starts after
    layer n-1's attention of the same token; each gather after the compute that chose its rows; each row copy after
    its gather."""
    last = {}
    for s in spans:
        assert s.start >= s.needs - 1e-12, s
        if s.lane == "compute" and s.what == "attention":
            last["attn", s.layer] = s.end
        if s.lane == "compute" and s.what.startswith("predict layer"):
            n = int(s.what.rsplit(" ", 1)[1])
            assert s.start >= last["attn", n - 1] - 1e-12, s
            last["chose", n] = s.end
        if s.lane == "compute" and s.what.startswith("mask"):
            last["chose", s.layer] = s.end
        if s.lane == "host":
            assert s.start >= last["chose", s.layer] - 1e-12 and s.needs >= last["chose", s.layer] - 1e-12, s
            last["gather", s.layer, s.what.split()[-1]] = s.end
        if s.lane == "transfer" and s.what.startswith("rows"):
            assert s.start >= last["gather", s.layer, s.what.split()[-1]] - 1e-12, s


@pytest.mark.parametrize("policy", ["floe", "mixtral"])
def test_decode_timeline_is_causal(policy):
    from lab.models.zoo import tiny_mixtral
    from lab.moe.offload import OffloadEngine

    torch.manual_seed(0)
    model = tiny_mixtral(vocab_size=40, d_model=32, n_layers=3, n_heads=4, d_ff=48, n_experts=4).eval()
    seq = torch.randint(40, (1, 8), generator=torch.Generator().manual_seed(3))
    eng = OffloadEngine(model, policy, SimLink(TimeModel.mixtral_equivalent(32, 48)), keep=0.25)
    eng.run(seq)
    spans = eng.link.spans
    assert {s.lane for s in spans} >= {"compute", "transfer"} and any(s.what == "attention" for s in spans)
    _causal(spans)
    if policy == "floe":
        assert any(s.lane == "host" for s in spans) and any(s.what.startswith("mask") for s in spans)
        gathers = [s for s in spans if s.lane == "host"]
        assert all(s.end > s.start for s in gathers)  # the host gather is charged
        # the prefetch still overlaps compute: some gather runs while an expert of the layer before computes
        assert any(g.start < c.end and c.start < g.end for g in gathers for c in spans
                   if c.lane == "compute" and c.what.startswith("expert") and c.layer == g.layer - 1)
    broken = [*spans]  # a prediction moved before its attention is caught
    p = next(i for i, s in enumerate(broken) if s.what.startswith("predict"))
    early = broken[p].start - 1.0  # and its recorded needs with it: only the attention rule can catch it
    broken[p] = type(broken[p])(**{**vars(broken[p]), "start": early, "needs": early})
    with pytest.raises(AssertionError):
        _causal(broken)
