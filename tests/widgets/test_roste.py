"""The RoSTE outlier explorer: built from data, its controls change what it shows."""

import plotly.graph_objects as go

from lab.widgets.roste import channel_figure, error_figure, outlier_explorer, outlier_figure


def passes():
    flat = {"q": [1.0] * 8, "down": [2.0] * 8}
    spike = {"q": [1.0] * 7 + [100.0], "down": [2.0] * 7 + [40.0]}
    layer = lambda ch: {"R2": 0.1, "R3": 0.2, "R4": 0.3, "total": 1.0, "channels": ch}
    return {"no rotation": [layer(spike), layer(spike)], "R1": [layer(flat), layer({**flat, "q": [3.0] * 8})]}


SEARCH = {"off": [{"R2": 1.0, "R3": 1.0, "R4": 1.0}] * 2, "on": [{"R2": 2.0, "R3": 0.5, "R4": 0.5}] * 2,
          "choice": [{"R2": False, "R3": True, "R4": True}] * 2}


def test_explorer_peak_follows_layer_and_input():
    box = outlier_explorer(passes(), SEARCH)
    assert box.peak["no rotation"] == 100.0 and box.peak["R1"] == 1.0
    layer, inp, log = box.controls
    inp.value = "down"
    assert box.peak["no rotation"] == 20.0
    layer.value = 1
    inp.value = "q"
    assert box.peak["R1"] == 1.0 and box.figure.data[1].y == tuple([3.0] * 8)
    log.value = False
    assert box.figure.layout.yaxis.type == "linear"


def test_offline_figures():
    fig = outlier_figure(passes(), title="t")
    assert isinstance(fig, go.Figure) and len(fig.data) == 2 * 2 * 2  # (layer, input) combos × configurations
    assert len(fig.layout.updatemenus[0].buttons) == 4
    assert sum(t.visible for t in fig.data) == 2
    e = error_figure(SEARCH)
    assert list(e.data[1].text) == ["★ I", "★ H", "★ H"] * 2
    assert channel_figure(passes(), 0, "q").data[0].y[-1] == 100.0
