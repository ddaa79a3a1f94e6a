import pytest

from lab.align import infalign as I
from lab.widgets.calibrated import calibrated_explorer, frontier_figure


def test_explorer_reports_what_the_analytical_tool_computes():
    box = calibrated_explorer(M=2000)
    c = box.controls
    c["t"].value, c["log_beta"].value, c["N"].value = 0.0, 0.0, 1
    u = I.grid(2000)
    q = I.density(I.identity, float(u.max() - u.min()), u)  # β is relative to Φ's range on the grid
    assert box.state["kl"] == pytest.approx(I.kl(q)) and f"KL = {I.kl(q):.3f}" in box.readout.value
    before = box.state["wN"]
    c["N"].value = 8
    assert box.state["wN"] != before and "BoN-8" in box.readout.value
    c["kind"].value = "won"
    assert "WoN-8" in box.readout.value and "−exp(−t·u)" not in box.readout.value  # t = 0: identity
    c["t"].value = 10.0
    assert "−exp(−t·u)" in box.readout.value
    assert len(box.figure.data[0].x) == 200


def test_frontier_figure_dropdown():
    fig = frontier_figure({"BoN-4": {"identity": ([0.1, 1.0], [0.6, 0.8]), "exp": ([0.1, 1.0], [0.65, 0.9])},
                           "WoN-4": {"identity": ([0.1, 1.0], [0.6, 0.9])}})
    assert len(fig.data) == 3 and [t.visible for t in fig.data] == [True, True, False]
    assert fig.layout.updatemenus[0].buttons[1].args[0]["visible"] == [False, False, True]


def test_the_figure_lives_in_the_output_widget_state():
    box = calibrated_explorer(M=1000)
    (out,) = [c for c in box.children if hasattr(c, "outputs")]
    data = out.outputs[0]["data"]["application/vnd.plotly.v1+json"]
    assert data["data"][0]["y"] == list(box.figure.data[0].y)
