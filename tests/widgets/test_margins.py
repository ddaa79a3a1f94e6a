import torch

from lab.widgets.margins import margin_explorer, margin_figure, reward_margins, summary

PI = torch.tensor([[0.0, -1.0, -3.0], [-2.0, -1.0, -4.0]])
REF = torch.zeros(2, 3)


def test_margins_by_hand():
    m = reward_margins(PI, REF, beta=0.5)
    torch.testing.assert_close(m["each"], torch.tensor([[0.5, 1.5], [-0.5, 1.0]]))
    torch.testing.assert_close(m["hardest"], torch.tensor([0.5, -0.5]))
    s = summary(m)
    assert s["share of prompts with a rejected ranked above"] == 0.5 and abs(s["mean hardest margin"]) < 1e-9


def test_explorer_switches_settings_and_prompts():
    runs = {"γ=0": {"dpo": (PI, REF), "hps": (PI + torch.tensor([[1.0, 0, 0]]), REF)},
            "γ=5": {"dpo": (PI * 2, REF), "hps": (PI, REF)}}
    box = margin_explorer(runs)
    assert "<td>dpo</td><td>0.000</td><td>0.500</td><td>1.000</td>" in box.readout.value
    box.controls["prompt"].value = 1
    assert "<td>dpo</td><td>0.000</td><td>0.500</td><td>-1.000</td>" in box.readout.value
    assert list(box.figure.data[0].y) == [-1.0, 2.0]
    box.controls["setting"].value = "γ=5"
    assert "<td>dpo</td><td>0.000</td><td>0.500</td><td>-2.000</td>" in box.readout.value
    fig = margin_figure(runs)
    assert len(fig.data) == 4 and [t.visible for t in fig.data] == [True, True, False, False]
