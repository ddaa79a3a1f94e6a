import math

import pytest
import torch

from lab.widgets.emi_bounds import derived, emi_explorer, grid_figure, image_html, images_figure, scatter_figure

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


def test_image_html_draws_every_pixel_clipped():
    img = torch.zeros(3, 2, 3)
    img[:, 1, 2] = torch.tensor([1.0, 0.5, 2.0])  # row 1, column 2; blue above 1 is clipped
    img[0, 0, 0] = -1.0  # clipped to 0
    svg = image_html(img, px=4)
    assert svg.startswith('<svg width="12" height="8"') and svg.count("<rect") == 6
    assert '<rect x="8" y="4" width="4" height="4" fill="rgb(255,128,255)"/>' in svg
    assert '<rect x="0" y="0" width="4" height="4" fill="rgb(0,0,0)"/>' in svg


def test_scenario_view_shows_each_examples_image():
    g = grid()
    for k, (r, c) in enumerate(g):
        img = torch.zeros(3, 8, 8)
        img[0] = k / 8  # the red channel tells the scenarios apart
        g[r, c]["examples"] = [ex + (img,) for ex in g[r, c]["examples"]]
    box = emi_explorer(g, ROWS, COLS)
    assert "<th>image</th>" in box.readout.value and box.readout.value.count("<rect") == 64
    assert 'fill="rgb(0,0,0)"' in box.readout.value
    box.controls["visual"].value, box.controls["textual"].value = 1, 2  # k = 5: red 0.625
    assert 'fill="rgb(159,0,0)"' in box.readout.value and "<td>blue</td>" in box.readout.value
    fig = images_figure(g, ROWS, n_examples=1)
    assert len(fig.data) == 2 and fig.data[1].z[0][0] == pytest.approx([96.0, 0.0, 0.0])  # k = 3: red 0.375


def test_scenario_view_without_images_keeps_its_table():
    box = emi_explorer(grid(), ROWS, COLS)
    assert "<th>image</th>" not in box.readout.value and "<svg" not in box.readout.value
