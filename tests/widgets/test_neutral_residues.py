from lab.widgets.neutral_residues import gate_figure, pareto_explorer, pareto_figure, token_html, token_view

TOKS = ["<bos>", "a1", "a2", "b70", "b90"]
LANGS = [0, 0, 0, 1, 1]
GATES = {"NR": [[0.0, 0.0, 0.1, 0.9, 1.2], [0.0, 0.2, 0.0, 0.5, 0.4]], "sig": [[0.1] * 5, [0.2] * 5]}


def test_token_html_colours_by_gate_and_marks_language():
    s = token_html(TOKS, GATES["NR"][0], LANGS)
    assert s.count("<span") == 5 and s.count("border-bottom") == 2
    assert "rgba(84,162,75,0.08)" in s and "rgba(84,162,75,0.93)" in s  # gate 0 -> palest, the max -> darkest


def test_token_view_follows_controls():
    box = token_view(TOKS, GATES, LANGS)
    assert box.values == GATES["NR"][0]
    model, layer = box.controls
    layer.value = 1
    assert box.values == GATES["NR"][1]
    model.value = "sig"
    assert box.values == [0.2] * 5 and "gate 0.200" in box.html.value


def test_gate_figure_buttons_switch_models():
    fig = gate_figure(TOKS, GATES, LANGS)
    assert len(fig.data) == 2 and fig.data[0].visible and not fig.data[1].visible
    assert fig.layout.updatemenus[0].buttons[1].args[0]["visible"] == [False, True]
    assert list(fig.data[0].x)[3].endswith("*")


def test_pareto_figure_one_line_per_method_and_the_backbone():
    fig = pareto_figure({"NR": [(1.5, 0.1, "lr=0.01"), (1.4, 0.2, "lr=0.03")], "FT": [(1.2, 0.5, "lr=0.01")]},
                        (2.0, 0.0), floor=1.0)
    assert [t.name for t in fig.data] == ["NR", "FT", "backbone"] and list(fig.data[0].x) == [1.5, 1.4]


def test_pareto_explorer_computes_missing_settings():
    calls = []

    def compute(a, p, e):
        calls.append((a, p, e))
        return (1.0 + a, p)

    box = pareto_explorer({(1.0, 0.1, 0.2): (1.6, 0.05)}, alphas=(0.1, 1.0), ps=(0.0, 0.1), extras=(0.2, 0.5),
                          reference={"FT": (1.2, 0.4)}, compute=compute, start=(1.0, 0.1, 0.2))
    assert box.point == (1.6, 0.05) and calls == []
    a, p, e = box.controls
    p.value = 0.0
    assert calls == [(1.0, 0.0, 0.2)] and box.point == (2.0, 0.0)
    p.value = 0.1
    assert len(calls) == 1 and box.point == (1.6, 0.05)  # cached
    off = pareto_explorer({(1.0, 0.1, 0.2): (1.6, 0.05)}, alphas=(0.1, 1.0), ps=(0.0, 0.1), extras=(0.2, 0.5),
                          reference={}, start=(1.0, 0.1, 0.2))
    off.controls[0].value = 0.1
    assert off.point is None
