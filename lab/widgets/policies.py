"""The λ explorer for tabular preference toys: how each loss's solution π_θ moves between π_ref and
π* as the regularization weight λ changes, per context (EXPO's preservation / interpolation tests).

Data in: `grid` = {context: {"pi_ref": (K,), "pi_star": (K,), "solutions": {method: (L, K)}}} over
`log_lams` (L,). `policy_explorer` is the live panel, `policy_figure` the same as a plotly figure
with a log λ slider, `distance_figure` the KL(π*‖π_θ)-vs-log λ curves, `trajectory_figure` the
sampled-pairs training trajectories and `lm_distance_figure` the tiny transformer's KL(π*‖π_θ) vs λ.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import plotly.graph_objects as go
import torch

from lab.widgets.next_token import bars_html

COLORS = {"pi_star": "#1a7f37", "pi_ref": "#888888", "dpo": "#cf222e", "ipo": "#bc4c00", "fdpo_js": "#8250df",
          "expo": "#0969da", "rlhf": "#6e7781"}


def kl_to_star(pi_star: torch.Tensor, solutions: torch.Tensor) -> torch.Tensor:
    """KL(π* ‖ π_θ) for each row of `solutions` (L, K): (L,)."""
    return (pi_star * (pi_star.log() - solutions.log())).sum(-1)


def distance_figure(grid: dict, log_lams: Sequence[float], *, title: str = "distance to π* vs log λ") -> go.Figure:
    fig = go.Figure()
    for ctx, g in grid.items():
        for method, sol in g["solutions"].items():
            fig.add_scatter(x=list(log_lams), y=kl_to_star(g["pi_star"], sol).tolist(), mode="lines+markers",
                            name=f"{method} ({ctx})", line=dict(color=COLORS.get(method), dash="solid" if
                                                                 ctx == list(grid)[0] else "dot"))
    fig.update_layout(title=title, xaxis_title="log λ", yaxis=dict(title="KL(π* ‖ π_θ)", type="log"), height=380)
    return fig


def trajectory_figure(trained: dict[str, tuple[torch.Tensor, torch.Tensor]], pi_star: torch.Tensor, *, every: int = 50,
                      solid: str = "expo", title: str = "training trajectories") -> go.Figure:
    """`trained` = {method: (final π_θ (K,), trajectory (S, K) recorded every `every` steps)}: one line per
    method and response, `solid` drawn solid and the others dotted, π* as horizontal references."""
    fig = go.Figure()
    for method, (_, traj) in trained.items():
        for y in range(traj.shape[1]):
            fig.add_scatter(y=traj[:, y].tolist(), mode="lines", name=f"{method}: π(y{y})",
                            line=dict(dash="solid" if method == solid else "dot"))
    for y, p in enumerate(pi_star.tolist()):
        fig.add_hline(y=p, line=dict(color=COLORS["pi_star"], width=1), annotation_text=f"π*(y{y})")
    fig.update_layout(title=title, xaxis_title=f"step / {every}", yaxis_title="probability", height=380)
    return fig


def lm_distance_figure(distances: dict[tuple[str, float], torch.Tensor], contexts: Sequence[str], *,
                       title: str = "KL(π*‖π_θ) vs λ") -> go.Figure:
    """`distances` = {(method, λ): KL(π* ‖ π_θ) per context (len(contexts),)}: one line per method and
    context over λ (log axes), the first context dotted."""
    methods = list(dict.fromkeys(m for m, _ in distances))
    fig = go.Figure()
    for method in methods:
        lams = [lam for m, lam in distances if m == method]
        for c, ctx in enumerate(contexts):
            fig.add_scatter(x=lams, y=[float(distances[method, lam][c]) for lam in lams], mode="lines+markers",
                            name=f"{method} ({ctx})", line=dict(dash="solid" if c else "dot"))
    fig.update_layout(title=title, xaxis=dict(title="λ", type="log"), yaxis=dict(title="KL(π* ‖ π_θ)", type="log"),
                      height=380)
    return fig


def policy_figure(grid: dict, log_lams: Sequence[float], *, title: str = "π_θ at each λ") -> go.Figure:
    """Grouped bars (π*, π_ref and each method's π_θ) per context, with a slider over log λ."""
    contexts = list(grid)
    fig = go.Figure()
    traces_per_step = []
    for k in range(len(log_lams)):
        idx = []
        for c, ctx in enumerate(contexts):
            g = grid[ctx]
            K = len(g["pi_star"])
            x = [f"{ctx}: y{y}" for y in range(K)]
            series = {"π*": g["pi_star"], "π_ref": g["pi_ref"]} | {m: s[k] for m, s in g["solutions"].items()}
            for name, p in series.items():
                key = {"π*": "pi_star", "π_ref": "pi_ref"}.get(name, name)
                idx.append(len(fig.data))
                fig.add_bar(x=x, y=p.tolist(), name=name, marker_color=COLORS.get(key), visible=k == 0,
                            legendgroup=name, showlegend=c == 0)
        traces_per_step.append(idx)
    n = len(fig.data)
    visible = [[i in set(idx) for i in range(n)] for idx in traces_per_step]
    steps = [dict(method="update", label=f"{ll:g}", args=[{"visible": visible[k]}]) for k, ll in enumerate(log_lams)]
    fig.update_layout(title=title, barmode="group", yaxis=dict(title="probability", range=[0, 1]), height=420,
                      sliders=[dict(active=0, currentvalue=dict(prefix="log λ = "), steps=steps, pad=dict(t=40))])
    return fig


def policy_explorer(grid: dict, log_lams: Sequence[float]):
    """Live panel: a log λ slider; for each context, bars of π*, π_ref and every method's π_θ, and
    each method's KL(π*‖π_θ). Test hooks: `.lam` (the slider), `.readout` (HTML), `.panels`."""
    import ipywidgets as w

    lam = w.SelectionSlider(options=[(f"{ll:g}", k) for k, ll in enumerate(log_lams)], description="log λ")
    readout = w.HTML()
    readout.add_class("lab-readout")
    panels = {ctx: w.HTML() for ctx in grid}

    def update(_=None):
        k = lam.value
        lines = []
        for ctx, g in grid.items():
            rows = [f"<b>{html.escape(ctx)}</b>"]
            for name, p in {"π*": g["pi_star"], "π_ref": g["pi_ref"]}.items():
                rows.append(f"<div>{name}</div>" + bars_html([f"y{y}" for y in range(len(p))], p.tolist(), top=len(p)))
            for m, sol in g["solutions"].items():
                d = float(kl_to_star(g["pi_star"], sol[k:k + 1])[0])
                rows.append(f"<div>{html.escape(m)}: KL(π*‖π_θ) = {d:.4f}</div>"
                            + bars_html([f"y{y}" for y in range(sol.shape[1])], sol[k].tolist(), top=sol.shape[1]))
                lines.append(f"{ctx}/{m} {d:.4f}")
            panels[ctx].value = "".join(rows)
        readout.value = f"log λ = {log_lams[k]:g}: " + html.escape(", ".join(lines))

    lam.observe(update, "value")
    update()
    box = w.VBox([lam, readout, w.HBox(list(panels.values()))])
    box.add_class("lab-explorer")
    box.lam, box.readout, box.panels = lam, readout, panels
    return box
