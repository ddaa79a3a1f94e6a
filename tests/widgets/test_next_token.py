import torch

from lab.widgets import heatmap, next_token_explorer, next_token_figure
from lab.widgets.next_token import bars_html, tempered

CHOICES = ["v0", "v1", "v2"]
LOGP = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]))


def test_tempered_is_a_tempered_softmax():
    torch.testing.assert_close(tempered(LOGP, 1.0), torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]))
    p = tempered(LOGP[0], 2.0)
    want = torch.tensor([0.7, 0.2, 0.1]).sqrt()
    torch.testing.assert_close(p, want / want.sum())


def test_explorer_callbacks_update_the_readout_and_bars():
    box = next_token_explorer(["k1 v0 ? k1", "k2 v2 ? k2"], ["v0", "v2"], LOGP, CHOICES)
    assert "lab-explorer" in box._dom_classes and "lab-readout" in box.readout._dom_classes
    assert "predicts v0 (p = 0.700, correct)" in box.readout.value
    box.temperature.value = 2.0  # what a user's drag does; the observer runs synchronously
    assert "T = 2.00" in box.readout.value and "p = 0.523" in box.readout.value
    box.example.value = 1
    assert "predicts v2" in box.readout.value and "answer v2" in box.readout.value
    assert box.bars.value.index("v2") < box.bars.value.index("v1")  # sorted by probability


def test_precomputed_figure_has_one_trace_per_temperature():
    fig = next_token_figure(LOGP[0], CHOICES, "v0", temperatures=(0.5, 1.0, 2.0))
    assert len(fig.data) == 3 and [t.visible for t in fig.data] == [True, False, False]
    steps = fig.layout.sliders[0].steps
    assert [s.args[0]["visible"] for s in steps] == [[True, False, False], [False, True, False], [False, False, True]]
    torch.testing.assert_close(torch.tensor(fig.data[1].y), torch.tensor([0.7, 0.2, 0.1]))


def test_bars_and_heatmap():
    html = bars_html(["a", "b"], [0.25, 0.75], highlight="a")
    assert html.index(">b<") < html.index(">a<") and "0.750" in html
    fig = heatmap(torch.eye(2), x=["h0", "h1"], y=["l0", "l1"], title="t")
    assert fig.data[0].z == ((1.0, 0.0), (0.0, 1.0)) or list(map(list, fig.data[0].z)) == [[1, 0], [0, 1]]
