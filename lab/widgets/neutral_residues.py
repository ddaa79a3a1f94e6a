"""Neutral-residue views: a token view colouring a mixed A/B sequence by each layer's gate value, and a Pareto
explorer (forgetting on the original language vs learning of the new one) over α, p and adapter width.

`gate_figure` and `pareto_figure` are the precomputed plotly views that stay interactive offline in the report;
`token_view` and `pareto_explorer` are the live panels (ipywidgets) built from the same data.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence

import plotly.graph_objects as go

from lab.widgets.figures import show_in

COLORS = {"FT": "#E45756", "LoRA": "#F58518", "adapter": "#4C78A8", "NR": "#54A24B", "backbone": "#333333"}


def _shade(v: float, vmax: float) -> str:
    t = 0.0 if vmax <= 0 else max(0.0, min(1.0, v / vmax))
    return f"rgba(84,162,75,{0.08 + 0.85 * t:.2f})"


def token_html(tokens: Sequence[str], gates: Sequence[float], langs: Sequence[int], vmax: float | None = None) -> str:
    """One line of tokens, each on a background as green as its gate value (0 → white), the new-language tokens
    underlined; the gate value on hover."""
    vmax = max(gates) if vmax is None else vmax
    spans = [f'<span title="gate {g:.3f}" style="background:{_shade(g, vmax)};padding:2px 3px;margin:1px;'
             f'{"border-bottom:2px solid #4C78A8;" if lang else ""}font-family:monospace">{html.escape(t)}</span>'
             for t, g, lang in zip(tokens, gates, langs)]
    return '<div style="line-height:2">' + "".join(spans) + "</div>"


def token_view(tokens: Sequence[str], gates: dict[str, list[list[float]]], langs: Sequence[int]):
    """Live panel: a model (dropdown over `gates`' keys, each (layers, tokens) gate values) and a layer; the
    sequence coloured by gate. Hooks: `.controls`, `.html` (the HTML widget), `.values` (gates shown)."""
    import ipywidgets as w

    names = list(gates)
    model = w.Dropdown(options=names, description="model")
    layer = w.Dropdown(options=[(f"layer {l}", l) for l in range(len(gates[names[0]]))], description="layer")
    view = w.HTML()
    box = w.VBox([w.HBox([model, layer]), view,
                  w.HTML("<small>green = gate value of the token (darker: larger); underlined: language B</small>")])

    def update(_=None):
        box.values = gates[model.value][layer.value]
        view.value = token_html(tokens, box.values, langs)

    for c in (model, layer):
        c.observe(update, "value")
    box.controls, box.html = [model, layer], view
    update()
    return box


def gate_figure(tokens: Sequence[str], gates: dict[str, list[list[float]]], langs: Sequence[int], *,
                title: str = "") -> go.Figure:
    """Precomputed view: a heat map (layers × tokens) of gate values, buttons to switch the model; the x labels
    are the tokens (B tokens marked with *)."""
    labels = [f"{i}:{t}{'*' if lang else ''}" for i, (t, lang) in enumerate(zip(tokens, langs))]
    fig = go.Figure()
    for k, (name, g) in enumerate(gates.items()):
        fig.add_heatmap(z=g, x=labels, y=[f"layer {l}" for l in range(len(g))], colorscale="Greens", visible=k == 0,
                        name=name, hovertemplate="%{y}, %{x}: gate %{z:.3f}<extra></extra>")
    buttons = [dict(label=name, method="update", args=[{"visible": [j == k for j in range(len(gates))]}])
               for k, name in enumerate(gates)]
    fig.update_layout(title=title, height=260, updatemenus=[dict(buttons=buttons, x=1.0, y=1.25, xanchor="right")],
                      margin=dict(t=70, b=80))
    fig.update_xaxes(tickangle=-60)
    return fig


def pareto_figure(points: dict[str, list[tuple[float, float, str]]], base: tuple[float, float], *,
                  title: str = "", floor: float | None = None) -> go.Figure:
    """Forgetting ΔL_A (y) against learning L_B (x), one line per method through its learning rates
    (each point labelled), the backbone as a black star; down-left is better."""
    fig = go.Figure()
    for name, pts in points.items():
        pts = sorted(pts, key=lambda t: t[2])
        fig.add_scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], text=[p[2] for p in pts], mode="lines+markers",
                        name=name, line=dict(color=COLORS.get(name.split(",")[0])),
                        hovertemplate=name + " %{text}: L_B %{x:.3f}, ΔL_A %{y:+.3f}<extra></extra>")
    fig.add_scatter(x=[base[0]], y=[base[1]], mode="markers", marker=dict(symbol="star", size=14, color="black"),
                    name="backbone")
    if floor is not None:
        fig.add_vline(x=floor, line_dash="dot", annotation_text="B entropy floor")
    fig.update_layout(title=title, xaxis_title="L_B: held-out loss on the new language (nats/token) →  learn",
                      yaxis_title="ΔL_A: forgetting on the original language (nats/token)", height=460)
    return fig


def pareto_explorer(points: dict[tuple[float, float, float], tuple[float, float]], *, alphas: Sequence[float],
                    ps: Sequence[float], extras: Sequence[float], reference: dict[str, tuple[float, float]],
                    compute: Callable[[float, float, float], tuple[float, float]] | None = None,
                    start: tuple[float, float, float] | None = None):
    """Live panel: sliders for α, p and the adapter width (extra parameters / backbone); the NR point they select
    on the (L_B, ΔL_A) plane beside the `reference` points (the baselines). A setting missing from `points` is
    trained by `compute(alpha, p, extra)` (a few seconds) when given, else reported as not computed.
    Hooks: `.controls`, `.figure`, `.point` (the (L_B, ΔL_A) shown or None), `.points`."""
    import ipywidgets as w

    start = start or next(iter(points))
    a = w.SelectionSlider(options=list(alphas), value=start[0], description="α")
    p = w.SelectionSlider(options=list(ps), value=start[1], description="p")
    e = w.SelectionSlider(options=list(extras), value=start[2], description="width",
                          tooltip="adapter parameters / backbone parameters")
    note, out = w.HTML(), w.Output()
    box = w.VBox([w.HBox([a, p, e]), note, out])
    box.points = dict(points)

    def update(_=None):
        key = (a.value, p.value, e.value)
        if key not in box.points and compute is not None:
            box.points[key] = compute(*key)
        box.point = box.points.get(key)
        fig = go.Figure()
        for name, (x, y) in reference.items():
            fig.add_scatter(x=[x], y=[y], mode="markers+text", text=[name], textposition="top center", name=name,
                            marker=dict(color=COLORS.get(name.split(",")[0], "#999"), size=10))
        xs = [v[0] for v in box.points.values()]
        ys = [v[1] for v in box.points.values()]
        fig.add_scatter(x=xs, y=ys, mode="markers", marker=dict(color="#54A24B", opacity=0.3), name="NR (computed)")
        if box.point is not None:
            fig.add_scatter(x=[box.point[0]], y=[box.point[1]], mode="markers",
                            marker=dict(color="#54A24B", size=16, symbol="diamond"), name="NR (selected)")
        fig.update_layout(xaxis_title="L_B", yaxis_title="ΔL_A", height=420, title=f"α={key[0]}, p={key[1]}, "
                          f"width {key[2]:.0%} extra parameters")
        note.value = (f"L_B {box.point[0]:.3f}, ΔL_A {box.point[1]:+.3f}" if box.point
                      else "<i>not computed here (no trainer attached)</i>")
        box.figure = fig
        show_in(out, fig)

    for c in (a, p, e):
        c.observe(update, "value")
    box.controls = [a, p, e]
    update()
    return box
