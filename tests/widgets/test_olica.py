"""The Olica spectra explorer and its precomputed view."""

from __future__ import annotations

from lab.widgets.olica import cut, spectra_explorer, spectra_offline

SPECTRA = {(0, 0): {"fast": [8.0, 4.0, 2.0, 1.0], "full": [9.0, 3.0, 1.0, 0.5]},
           (1, 2): {"fast": [5.0, 5.0, 1.0, 0.1], "full": [6.0, 2.0, 1.0, 0.2]}}


def test_cut_follows_sr_allocation():
    assert cut(16, 0.33, 3.0) == round((1 - 0.165) * 16) == 13
    assert cut(4, 0.0) == 4


def test_explorer_moves_the_cut_with_the_slider_and_switches_heads():
    box = spectra_explorer(SPECTRA, s=0.2)
    pick, sl = box.controls

    def cut_x():
        return box.figure.layout.shapes[0].x0

    assert cut_x() == cut(4, 0.2) + 0.5
    sl.value = 0.6
    assert cut_x() == cut(4, 0.6) + 0.5 < cut(4, 0.2) + 0.5
    pick.value = (1, 2)
    assert list(box.figure.data[0].y) == SPECTRA[1, 2]["fast"] and "layer 1, head 2" in box.figure.layout.title.text


def test_offline_view_has_a_trace_pair_per_head_and_a_slider_step_per_sparsity():
    fig = spectra_offline(SPECTRA, [0.2, 0.33, 0.5])
    assert len(fig.data) == 4 and [d.visible for d in fig.data] == [True, True, False, False]
    assert len(fig.layout.sliders[0].steps) == 3 and len(fig.layout.updatemenus[0].buttons) == 2
    assert fig.layout.sliders[0].steps[0].args[0]["shapes"][0]["x0"] == cut(4, 0.2) + 0.5
