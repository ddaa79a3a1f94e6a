"""HC-SMoE explorers: each layer's expert dendrogram (average linkage) beside its pairwise-distance heat map,
for a feature kind (expert outputs, router logits, weights), with the cut at r clusters.

`layer_figure` draws one layer; `cluster_figure` is the precomputed view for the report (every layer side by
side, a slider over r moving the cut lines); `cluster_explorer` is the live panel (layer, feature, r).
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from scipy.cluster.hierarchy import dendrogram, fcluster, linkage
from scipy.spatial.distance import squareform

from lab.widgets.figures import show_in


def tree(D: np.ndarray, link: str = "average") -> np.ndarray:
    """scipy's linkage matrix Z from a square distance matrix D (E, E)."""
    return linkage(squareform(np.asarray(D, dtype=float), checks=False), method=link)


def cut_height(Z: np.ndarray, r: int) -> float:
    """A height between the merge that leaves r clusters and the next one (the dendrogram's cut line)."""
    h = np.concatenate([[0.0], Z[:, 2], [Z[-1, 2] * 1.1 or 1.0]])
    n = len(Z) + 1
    return float((h[n - r] + h[n - r + 1]) / 2)


def groups(D: np.ndarray, r: int, link: str = "average") -> list[int]:
    """Cluster label (0-based) of each expert at r clusters."""
    return (fcluster(tree(D, link), r, criterion="maxclust") - 1).tolist()


def _add_layer(fig: go.Figure, D: np.ndarray, col: int, name: str) -> None:
    d = dendrogram(tree(D), no_plot=True)
    order = d["leaves"]
    for xs, ys in zip(d["icoord"], d["dcoord"]):
        fig.add_scatter(x=xs, y=ys, mode="lines", line=dict(color="#4C78A8"), showlegend=False, hoverinfo="skip",
                        row=1, col=col)
    fig.update_xaxes(tickvals=[5 + 10 * i for i in range(len(order))], ticktext=[f"e{e}" for e in order],
                     row=1, col=col)
    Dz = np.asarray(D)[np.ix_(order, order)]
    labels = [f"e{e}" for e in order]
    fig.add_heatmap(z=Dz.tolist(), x=labels, y=labels, colorscale="Blues", showscale=col == 1, row=2, col=col,
                    hovertemplate=name + " %{y}–%{x}: %{z:.3g}<extra></extra>")
    fig.update_yaxes(autorange="reversed", row=2, col=col)


def _cut_shapes(dists: list[np.ndarray], r: int) -> list[dict]:
    return [dict(type="line", xref=f"x{i + 1 if i else ''} domain", yref=f"y{i + 1 if i else ''}", x0=0, x1=1,
                 y0=cut_height(tree(D), r), y1=cut_height(tree(D), r), line=dict(color="#E45756", dash="dash"))
            for i, D in enumerate(dists)]


def cluster_figure(dists: list[np.ndarray], r: int = 4, *, title: str = "") -> go.Figure:
    """Every layer's dendrogram (top) and leaf-ordered distance heat map (bottom); a slider over r moves the
    dashed cut lines (r clusters lie below each). Works offline in the report."""
    L, E = len(dists), len(dists[0])
    fig = make_subplots(rows=2, cols=L, subplot_titles=[f"layer {l}" for l in range(L)], vertical_spacing=0.12)
    for l, D in enumerate(dists):
        _add_layer(fig, D, l + 1, f"layer {l}")
    steps = [dict(label=str(k), method="relayout", args=[{"shapes": _cut_shapes(dists, k)}]) for k in range(1, E + 1)]
    fig.update_layout(title=title, height=560, shapes=_cut_shapes(dists, r),
                      sliders=[dict(active=r - 1, steps=steps, currentvalue=dict(prefix="r = "), y=-0.05)])
    return fig


def layer_figure(D: np.ndarray, r: int, *, title: str = "") -> go.Figure:
    """One layer: dendrogram with the cut at r, and the distance heat map with each cluster's block outlined."""
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.12)
    _add_layer(fig, D, 1, "")
    order = dendrogram(tree(D), no_plot=True)["leaves"]
    lab = np.asarray(groups(D, r))[order]
    shapes = _cut_shapes([D], r)
    start = 0
    for i in range(1, len(lab) + 1):
        if i == len(lab) or lab[i] != lab[start]:  # a run of one cluster along the leaf order
            shapes.append(dict(type="rect", xref="x2", yref="y2", x0=start - 0.5, x1=i - 0.5, y0=start - 0.5,
                               y1=i - 0.5, line=dict(color="#E45756", width=2)))
            start = i
    fig.update_layout(title=title, height=620, shapes=shapes)
    return fig


def cluster_explorer(dists: dict[str, list[np.ndarray]], r: int = 4):
    """Live panel: layer, feature kind and r. Hooks: `.figure`, `.labels` (clusters now shown), `.controls`."""
    import ipywidgets as w

    kinds = list(dists)
    L, E = len(dists[kinds[0]]), len(dists[kinds[0]][0])
    layer = w.Dropdown(options=[(f"layer {l}", l) for l in range(L)], description="layer")
    kind = w.Dropdown(options=kinds, description="feature")
    rr = w.IntSlider(value=r, min=1, max=E, description="r")
    out = w.Output()
    box = w.VBox([w.HBox([layer, kind, rr]), out])
    box.add_class("lab-explorer")

    def update(_=None):
        D = dists[kind.value][layer.value]
        box.labels = groups(D, rr.value)
        box.figure = layer_figure(D, rr.value, title=f"layer {layer.value}, {kind.value} features: groups {box.labels}")
        show_in(out, box.figure)

    for c in (layer, kind, rr):
        c.observe(update, "value")
    box.controls = [layer, kind, rr]
    update()
    return box
