import math

import pytest

from lab.widgets.calibrated import calibrated_explorer, frontier_figure


def test_explorer_reports_what_the_analytical_tool_computes():
    box = calibrated_explorer(M=2000)
    c = box.controls
    c["t"].value, c["log_beta"].value, c["N"].value = 0.0, 0.0, 1
    # Φ = identity, β = Φ's range on the 2000-cell grid = 1999/2000: q(u) = e^{u/β} / (β(e^{1/β} − 1)) on [0, 1],
    # so E_q[u] = 1/(1 − e^{−1/β}) − β (the standard win rate P(u_π > u_ref) = ∫ q(u)·u du) and
    # KL = ∫ q log q = E_q[u]/β − log(β(e^{1/β} − 1)) (closed forms; the grid's midpoint rule is within 1e-7)
    b = 1999 / 2000
    mean_u = 1 / (1 - math.exp(-1 / b)) - b
    kl = mean_u / b - math.log(b * (math.exp(1 / b) - 1))
    assert box.state["kl"] == pytest.approx(kl, abs=1e-6) and f"KL = {kl:.3f}" in box.readout.value
    assert box.state["w1"] == pytest.approx(mean_u, abs=1e-6) and f"standard win = {mean_u:.3f}" in box.readout.value
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
