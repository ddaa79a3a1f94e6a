import math

import pytest

from lab.widgets.emi_bounds import derived, emi_explorer, grid_figure, scatter_figure

ROWS, COLS = [("clean", 0), ("blur", 3)], [("clean", 0), ("typo", 1), ("typo", 3)]


def grid():
    out, k = {}, 0
    for r in ROWS:
        for c in COLS:
            out[r, c] = {"emi": -0.1 * k + 0.0, "rp": 1 - 0.1 * k, "jsd": (0.01 * k, 0.02 * k, 0.001, 0.003 * k),
                         "examples": [(["what", "colour"], ["red"], ["blue" if k else "red"])]}
            k += 1
    return out


def test_derived_metrics_and_views():
    g = grid()
    d = derived(g)
    assert d[ROWS[1], COLS[2]]["EMID"] == pytest.approx(0.5)  # EMI(ID) − EMI(OOD) = 0 − (−0.5)
    # k = 1: JSDs (0.01, 0.02, 0.001, 0.003); the bound is √JSD_v + √JSD_t + JSD_py^¼ + JSD_qy^¼
    want = math.sqrt(0.01) + math.sqrt(0.02) + 0.001**0.25 + 0.003**0.25
    assert d[ROWS[0], COLS[1]]["bound"] == pytest.approx(want)
    assert grid_figure(g, ROWS, COLS, "RP").data[0].z[1][2] == pytest.approx(0.5)
    _, r, p = scatter_figure(g)
    assert r > 0.9 and p < 0.05


def test_explorer_follows_its_controls():
    g = grid()
    box = emi_explorer(g, ROWS, COLS)
    c = box.controls
    assert box.heatmap.data[0].z[0][0] == 0.0 and "EMID 0.000" in box.readout.value
    c["metric"].value = "EMID"
    assert box.heatmap.data[0].z[1][2] == pytest.approx(0.5)
    c["visual"].value, c["textual"].value = 1, 2
    assert "EMID 0.500" in box.readout.value and "<td>blue</td>" in box.readout.value
    terms = list(box.bars.data[0].y)
    assert terms == pytest.approx([0.05**0.5, 0.1**0.5, 0.001**0.25, 0.015**0.25])
    r0 = box.r
    c["scaled"].value = True
    c["h_hat"].value = 3.0
    assert box.heatmap.data[0].z[1][2] == pytest.approx(0.5)  # EMID does not depend on the bound's form
    assert "Ĥ = 3" in box.scatter.layout.title.text and box.r != r0
