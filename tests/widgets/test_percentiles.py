import pytest
import torch

from lab.align import rip
from lab.widgets.percentiles import percentile_explorer, percentile_figure

NAMES = ["clean", "bad"]


def pool():
    g = torch.Generator().manual_seed(0)
    r = torch.cat([0.6 + 0.4 * torch.rand(30, 4, generator=g), torch.rand(20, 4, generator=g)])
    length = torch.randint(0, 7, (50, 4), generator=g)
    return rip.best_vs_worst(r, length), torch.cat([torch.zeros(30), torch.ones(20)]).long()


def naive_stats(p, kind, q):
    """RIP by hand: τ = the q-quantiles (linear interpolation) of m1, m2, m3 over the valid pairs; keep the
    valid pairs with m1 ≥ τ1, m2 ≥ τ2, m3 ≤ τ3; the share of each kind in the kept set."""
    valid = [i for i in range(len(kind)) if p.valid[i]]

    def quantile(m, qq):
        v = sorted(float(m[i]) for i in valid)
        pos = qq * (len(v) - 1)
        lo = int(pos)
        return v[lo] + (pos - lo) * (v[min(lo + 1, len(v) - 1)] - v[lo])

    tau = tuple(quantile(m, qq) for m, qq in zip((p.m1, p.m2, p.m3), q))
    kept = [i for i in valid if p.m1[i] >= tau[0] and p.m2[i] >= tau[1] and p.m3[i] <= tau[2]]
    share = {name: sum(int(kind[i]) == k for i in kept) / max(1, len(kept)) for k, name in enumerate(NAMES)}
    return tau, len(kept), len(valid), share


def test_explorer_follows_the_sliders():
    p, kind = pool()
    box = percentile_explorer(p, kind, NAMES)
    tau, kept, valid, share = naive_stats(p, kind, (0.5, 0.5, 0.5))
    assert box.stats["tau"] == pytest.approx(tau) and (box.stats["kept"], box.stats["valid"]) == (kept, valid)
    assert box.stats["share"] == pytest.approx(share) and f"kept <b>{kept}</b> of {valid}" in box.readout.value
    assert [t.name for t in box.figure.data] == NAMES
    box_shape = box.figure.layout.shapes[0]
    assert box_shape.x0 == pytest.approx(tau[0]) and box_shape.y1 == pytest.approx(tau[2])
    box.controls[0].value = 0  # no bound on the rejected reward: more kept
    tau0, loose, _, share0 = naive_stats(p, kind, (0.0, 0.5, 0.5))
    assert box.stats["tau"] == pytest.approx(tau0) and box.stats["kept"] == loose and loose > kept
    assert box.stats["share"] == pytest.approx(share0)


def test_precomputed_view():
    p, kind = pool()
    fig = percentile_figure(p, kind, NAMES, bad=[1])
    shares = [naive_stats(p, kind, (q, q, q))[3]["bad"] for q in (0.25, 0.5, 0.75)]
    assert list(fig.data[0].y) == pytest.approx(shares)
