import torch

from lab.align import rip
from lab.widgets.percentiles import kept_stats, percentile_explorer, percentile_figure

NAMES = ["clean", "bad"]


def pool():
    g = torch.Generator().manual_seed(0)
    r = torch.cat([0.6 + 0.4 * torch.rand(30, 4, generator=g), torch.rand(20, 4, generator=g)])
    length = torch.randint(0, 7, (50, 4), generator=g)
    return rip.best_vs_worst(r, length), torch.cat([torch.zeros(30), torch.ones(20)]).long()


def test_explorer_follows_the_sliders():
    p, kind = pool()
    box = percentile_explorer(p, kind, NAMES)
    want = kept_stats(p, kind, NAMES, (0.5, 0.5, 0.5))
    assert box.stats == want and f"kept <b>{want['kept']}</b>" in box.readout.value
    assert [t.name for t in box.figure.data] == NAMES
    assert box.figure.layout.shapes[0].x0 == want["tau"][0] and box.figure.layout.shapes[0].y1 == want["tau"][2]
    box.controls[0].value = 0  # no bound on the rejected reward: more kept
    loose = kept_stats(p, kind, NAMES, (0.0, 0.5, 0.5))
    assert box.stats == loose and loose["kept"] >= want["kept"]
    assert loose["kept"] == int(rip.keep(p, rip.thresholds(p, (0.0, 0.5, 0.5))).sum())


def test_precomputed_view():
    p, kind = pool()
    fig = percentile_figure(p, kind, NAMES, bad=[1])
    shares = [kept_stats(p, kind, NAMES, (q, q, q))["share"]["bad"] for q in (0.25, 0.5, 0.75)]
    assert list(fig.data[0].y) == shares
