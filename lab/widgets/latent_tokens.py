"""Token Assorted explorers: the accuracy-vs-length frontier with a slider over the number of latent chunks, and a
per-example view that decodes each generated latent token back to text through the VQ-VAE decoder.

`frontier_figure` is the precomputed view (a plotly slider over forced chunk counts; works offline);
`frontier_explorer` and `example_explorer` are the live panels (ipywidgets).
"""

from __future__ import annotations

import html

import plotly.graph_objects as go

from lab.widgets.figures import show_in

BASE = {"Sol-Only": "#9D755D", "CoT": "#4C78A8", "Latent-AR": "#54A24B"}


def frontier_figure(points: dict[str, tuple[float, float]], frontier: dict[int, tuple[float, float]], *,
                    title: str = "") -> go.Figure:
    """Accuracy (y) vs mean generated tokens (x): the baselines and Latent-AR as points, the forced-m curve of the
    latent model, and a slider marking the point with k latent chunks. `points`: name -> (tokens, acc);
    `frontier`: k -> (tokens, acc)."""
    ks = sorted(frontier)
    fig = go.Figure()
    fig.add_scatter(x=[frontier[k][0] for k in ks], y=[frontier[k][1] for k in ks], mode="lines+markers",
                    name="latent model, forced k chunks", line=dict(color="#B0B0B0"),
                    text=[f"k = {k}" for k in ks],
                    hovertemplate="%{text}: %{x:.1f} tokens, acc %{y:.3f}<extra></extra>")
    for name, (x, y) in points.items():
        fig.add_scatter(x=[x], y=[y], mode="markers+text", name=name, text=[name], textposition="top center",
                        marker=dict(size=13, color=BASE.get(name, "#E45756")))
    fig.add_scatter(x=[frontier[ks[0]][0]], y=[frontier[ks[0]][1]], mode="markers", name="selected k",
                    marker=dict(size=18, color="rgba(0,0,0,0)", line=dict(color="#E45756", width=3)))
    sel = len(fig.data) - 1
    steps = [dict(label=str(k), method="restyle", args=[{"x": [[frontier[k][0]]], "y": [[frontier[k][1]]]}, [sel]])
             for k in ks]
    fig.update_layout(title=title, xaxis_title="mean generated tokens (latent + text)", yaxis_title="accuracy",
                      yaxis_range=[0, 1.05], height=440,
                      sliders=[dict(active=0, steps=steps, currentvalue=dict(prefix="latent chunks k = "))])
    return fig


def frontier_explorer(points: dict[str, tuple[float, float]], frontier: dict[int, tuple[float, float]]):
    """Live panel: a slider over k; `.figure` and `.selected` ((tokens, acc) at k) follow it."""
    import ipywidgets as w

    ks = sorted(frontier)
    k = w.IntSlider(value=ks[-1], min=ks[0], max=ks[-1], description="latent chunks")
    out, label = w.Output(), w.HTML()
    box = w.VBox([k, label, out])
    box.add_class("lab-explorer")

    def update(_=None):
        box.selected = frontier[k.value]
        label.value = f"k = {k.value}: {box.selected[0]:.1f} tokens, accuracy {box.selected[1]:.3f}"
        box.figure = frontier_figure(points, {kk: frontier[kk] for kk in ks if kk <= k.value}, title="")
        show_in(out, box.figure)

    k.observe(update, "value")
    box.controls = [k]
    update()
    return box


def example_html(row: dict) -> str:
    """One generation: latent tokens coloured, each chunk's decoded text beneath, the verdict."""
    chips, j = [], 0
    for w in row["generated"]:
        if w.startswith("<z"):
            text = row["decoded"][j] if j < len(row["decoded"]) else "?"
            chips.append(f"<span style='background:#DCEFD9;padding:1px 3px;margin:1px;display:inline-block'>"
                         f"{html.escape(w)}<br><small>{html.escape(text)}</small></span>")
            j += 1
        else:
            chips.append(f"<span style='padding:1px 3px;margin:1px;display:inline-block'>{html.escape(w)}</span>")
    mark = "✓" if row["correct"] else "✗"
    return (f"<div><code>{html.escape(row['prompt'])}</code></div><div style='line-height:2.2em'>"
            f"{''.join(chips)} <b>{mark}</b></div>")


def example_explorer(rows: list[dict]):
    """Live panel: pick an example; `.html` holds what is shown."""
    import ipywidgets as w

    pick = w.IntSlider(value=0, min=0, max=len(rows) - 1, description="example")
    view = w.HTML()
    box = w.VBox([pick, view])
    box.add_class("lab-explorer")

    def update(_=None):
        box.html = view.value = example_html(rows[pick.value])

    pick.observe(update, "value")
    box.controls = [pick]
    update()
    return box
