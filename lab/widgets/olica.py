"""Olica explorers: per-head singular spectra of the V/O products with the pruning cut, and the precomputed view.

`spectra[(layer, head)]` holds Fast OND's singular values (of the output-energy-weighted W_o^h) and full OND's (of
the weighted d×d product W_o^h W_v^h), as `lab.compress.olica_study.head_spectra` returns them. The cut is where V/O
pruning at sparsity s stops: every head keeps d_v' = round((1 − s_vp)·d_h) neurons, s_vp = 2s/(1+k).
"""

from __future__ import annotations

import plotly.graph_objects as go

from lab.widgets.figures import show_in

COLORS = {"fast": "#4C78A8", "full": "#F58518"}
NAMES = {"fast": "Fast OND: S of diag(√e_out)·W_o^h", "full": "full OND: S of the weighted W_o^h W_v^h"}


def cut(d_h: int, s: float, k: float = 3.0) -> int:
    """Kept value neurons per head at target sparsity s (`sr_allocation`)."""
    return round((1 - 2 * s / (1 + k)) * d_h)


def spectrum_figure(spectra: dict, key: tuple[int, int], s: float, k: float = 3.0) -> go.Figure:
    """Singular values of one head (log scale) and the cut at sparsity s (neurons right of it are pruned)."""
    fig = go.Figure()
    for name, vals in spectra[key].items():
        fig.add_scatter(x=list(range(1, len(vals) + 1)), y=vals, mode="lines+markers", name=NAMES[name],
                        line_color=COLORS[name])
    c = cut(len(spectra[key]["fast"]), s, k)
    fig.add_vline(x=c + 0.5, line_dash="dot", annotation_text=f"cut: keep {c} at s = {s:g}")
    fig.update_layout(title=f"layer {key[0]}, head {key[1]}: V/O spectrum", height=360, xaxis_title="neuron",
                      yaxis_title="singular value", yaxis_type="log")
    return fig


def spectra_explorer(spectra: dict, *, k: float = 3.0, s: float = 0.33):
    """Live panel: (layer, head) dropdown and a sparsity slider. Hooks: `.figure`, `.controls`."""
    import ipywidgets as w

    pick = w.Dropdown(options=[(f"layer {l}, head {h}", (l, h)) for l, h in spectra], description="head")
    sl = w.FloatSlider(value=s, min=0.05, max=0.6, step=0.01, description="sparsity s")
    out = w.Output()
    box = w.VBox([w.HBox([pick, sl]), out])
    box.add_class("lab-explorer")

    def update(_=None):
        box.figure = spectrum_figure(spectra, pick.value, sl.value, k)
        show_in(out, box.figure)

    pick.observe(update, "value")
    sl.observe(update, "value")
    box.controls = [pick, sl]
    update()
    return box


def spectra_offline(spectra: dict, sparsities, *, k: float = 3.0) -> go.Figure:
    """Precomputed view for the static report: a dropdown over heads, a slider over sparsities moving the cut."""
    keys, fig = list(spectra), go.Figure()
    n = len(next(iter(spectra.values())))
    for i, key in enumerate(keys):
        for name, vals in spectra[key].items():
            fig.add_scatter(x=list(range(1, len(vals) + 1)), y=vals, mode="lines+markers", visible=i == 0,
                            name=f"{NAMES[name]}", line_color=COLORS[name], showlegend=i == 0)
    d_h = len(spectra[keys[0]]["fast"])

    def line(s):
        c = cut(d_h, s, k)
        return [dict(type="line", x0=c + 0.5, x1=c + 0.5, y0=0, y1=1, yref="paper", line=dict(dash="dot"))]

    buttons = [dict(label=f"layer {l}, head {h}", method="update",
                    args=[{"visible": [j == b for j in range(len(keys)) for _ in range(n)]},
                          {"title": f"layer {l}, head {h}: V/O spectrum"}]) for b, (l, h) in enumerate(keys)]
    steps = [dict(label=f"{s:g}", method="relayout", args=[{"shapes": line(s)}]) for s in sparsities]
    fig.update_layout(height=400, yaxis_type="log", xaxis_title="neuron", yaxis_title="singular value",
                      shapes=line(sparsities[-1]), title=f"layer {keys[0][0]}, head {keys[0][1]}: V/O spectrum",
                      updatemenus=[dict(buttons=buttons, x=1.0, y=1.2)],
                      sliders=[dict(steps=steps, active=len(steps) - 1, currentvalue={"prefix": "sparsity s = "})])
    return fig
