import pytest
import torch

from lab.moe.links import Span
from lab.widgets.floe import activation_explorer, bytes_figure, histogram_figure, offload_explorer, timeline_figure


def acts():
    g = torch.Generator().manual_seed(0)
    return {(l, e): {"gate": torch.randn(50, 16, generator=g), "up": torch.randn(50, 16, generator=g),
                     "down": torch.randn(50, 16, generator=g)} for l in (1, 2) for e in (0, 1)}


def quantile(a, k):
    """The k-quantile of |a| with linear interpolation between order statistics, by hand."""
    v = sorted(abs(x) for x in a.flatten().tolist())
    pos = k * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (pos - lo) * (v[min(lo + 1, len(v) - 1)] - v[lo])


def test_histogram_dropdown_and_thresholds():
    a = acts()
    fig = histogram_figure(a, 0.8, bins=10)
    assert len(fig.data) == 4 * 3 and [t.visible for t in fig.data[:4]] == [True, True, True, False]
    assert sum(fig.data[0].y) == pytest.approx(1.0)  # shares of (token, neuron)
    t_up = quantile(a[1, 0]["up"], 0.8)
    assert fig.layout.shapes[1].x0 == pytest.approx(t_up)
    assert len(fig.layout.updatemenus[0].buttons) == 4


def test_activation_explorer_follows_controls():
    box = activation_explorer(acts())
    box.controls[0].value = (2, 1)
    box.controls[1].value = 0.5
    t = quantile(acts()[2, 1]["gate"], 0.5)
    assert box.figure.layout.shapes[0].x0 == pytest.approx(t)


def test_timeline_and_bytes():
    spans = [Span("transfer", 1, 0.001, 0.003, "rows 2"), Span("compute", 0, 0.001, 0.002, "attention")]
    fig = timeline_figure(spans, "t")
    assert [b.base[0] for b in fig.data] == [pytest.approx(0.0), pytest.approx(0.0)]
    assert fig.data[0].x[0] == pytest.approx(2.0)  # ms
    assert list(bytes_figure({"a": 10.0, "b": 5.0}, "b").data[0].y) == [10.0, 5.0]


def test_offload_explorer_calls_the_simulator():
    calls = []

    def simulate(gbps, keep, budget):
        calls.append((gbps, keep, budget))
        spans = [Span("transfer", 1, 0.0, 1.0 / gbps, "rows")]
        res = {"LRU": {"bytes": 5e3, "tps": 1.0, "spans": []}}
        if budget >= 100:
            res["floe"] = {"bytes": 1e3 * keep, "tps": gbps, "spans": spans, "resident": 2e3}
        return res

    box = offload_explorer(simulate)
    assert calls[-1] == (25, 0.2, 140) and "floe: <b>25.0</b>" in box.readout.value
    assert "2 kB on device" in box.readout.value and len(box.figure.data) == 1
    box.controls[2].value = 50
    assert calls[-1][2] == 50 and "FloE does not fit" in box.readout.value and len(box.figure.data) == 0
