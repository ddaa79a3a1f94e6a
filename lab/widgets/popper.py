"""POPPER explorers: the hypothesis card (one run replayed: proposal → relevance → p → e → cumulative E against
1/α) and log-E trajectories of null vs alternative sequences with the 1/α line.

`card_figure` and `log_e_figure` are the precomputed views for the report (buttons / a slider over precomputed
traces, offline); `hypothesis_card` is the live panel (group and run selectors). Rows come from
`lab.agents.popper_study.card_rows`.
"""

from __future__ import annotations

import html
import math

import numpy as np
import plotly.graph_objects as go

from lab.widgets.figures import show_in


def card_html(hypothesis: str, rows: list[dict], alpha: float) -> str:
    """The card as an HTML table; the verdict is the e-value decision (some E_i > 1/α)."""
    fmt = lambda v, f: "–" if v is None else format(v, f)
    body = "".join(
        f"<tr><td>{r['round']}</td><td>{html.escape(r['proposal'])}</td><td>{r['status']}</td>"
        f"<td>{fmt(r['relevance'], '.2f')}</td><td>{fmt(r['p'], '.3g')}</td><td>{fmt(r['e'], '.3g')}</td>"
        f"<td>{r['E']:.3g}</td></tr>" for r in rows)
    ok = any(r["status"] == "tested" and r["E"] > 1 / alpha for r in rows)
    verdict = f"<b style='color:{'#1a7f37' if ok else '#57606a'}'>{'VALIDATED' if ok else 'not validated'}</b>"
    return (f"<div class='lab-card'><p><b>{html.escape(hypothesis)}</b> — {verdict} (1/α = {1 / alpha:g})</p>"
            "<table><tr><th>#</th><th>proposal</th><th>status</th><th>relevance</th><th>p</th><th>e</th>"
            f"<th>E</th></tr>{body}</table></div>")


def _card_traces(rows: list[dict], alpha: float, visible: bool) -> list[go.Scatter]:
    x = [r["round"] for r in rows]
    text = [f"{r['proposal']}<br>{r['status']} rel={r['relevance']} p={r['p']}" for r in rows]
    return [go.Scatter(x=x, y=[math.log10(r["E"]) for r in rows], mode="lines+markers", text=text,
                       hoverinfo="text+y", name="log10 E", visible=visible),
            go.Scatter(x=[0.5, max(x + [1]) + 0.5], y=[math.log10(1 / alpha)] * 2, mode="lines", name="log10 1/α",
                       line=dict(dash="dash", color="#cf222e"), visible=visible)]


def card_figure(cards: dict[str, tuple[str, list[dict]]], alpha: float, *, title: str = "") -> go.Figure:
    """Precomputed view: one button per recorded run (label → (hypothesis, card rows)); works offline."""
    fig, labels = go.Figure(), list(cards)
    for i, k in enumerate(labels):
        fig.add_traces(_card_traces(cards[k][1], alpha, i == 0))
    buttons = [dict(label=k, method="update", args=[{"visible": [j // 2 == i for j in range(2 * len(labels))]},
                                                    {"title": f"{title}<br><sub>{cards[k][0]}</sub>"}])
               for i, k in enumerate(labels)]
    fig.update_layout(title=f"{title}<br><sub>{cards[labels[0]][0]}</sub>", height=380, xaxis_title="round",
                      yaxis_title="log10 cumulative E", updatemenus=[dict(buttons=buttons, x=1.0, y=1.25)])
    return fig


def hypothesis_card(cards: dict[str, tuple[str, list[dict]]], alpha: float):
    """Live panel: pick a recorded run; shows its card and E trajectory. Hooks: `.key`, `.html`, `.controls`."""
    import ipywidgets as w

    pick = w.Dropdown(options=list(cards), description="run")
    table, out = w.HTML(), w.Output()
    box = w.VBox([pick, table, out])
    box.add_class("lab-explorer")
    box.controls = [pick]

    def update(_=None):
        box.key = pick.value
        hyp, rows = cards[pick.value]
        table.value = box.html = card_html(hyp, rows, alpha)
        fig = go.Figure(_card_traces(rows, alpha, True))
        show_in(out, fig.update_layout(height=300, xaxis_title="round", yaxis_title="log10 E"))

    pick.observe(update, "value")
    update()
    return box


def log_e_figure(log_e: dict[str, np.ndarray], alphas=(0.05, 0.1, 0.2), *, title: str = "") -> go.Figure:
    """log E_i trajectories per group (e.g. null / alternative) with a slider over α moving the log(1/α) line."""
    fig, colors = go.Figure(), ("#8c959f", "#4C78A8", "#E45756", "#54A24B")
    for (name, L), c in zip(log_e.items(), colors):
        L = np.asarray(L)
        for j, row in enumerate(L):
            fig.add_scatter(x=list(range(len(row) + 1)), y=[0.0, *row.tolist()], mode="lines", name=name,
                            legendgroup=name, showlegend=j == 0, line=dict(color=c, width=1), opacity=0.6)
    n = len(fig.data)
    K = max(np.asarray(L).shape[1] for L in log_e.values())
    for i, a in enumerate(alphas):
        fig.add_scatter(x=[0, K], y=[math.log(1 / a)] * 2, mode="lines", name=f"log(1/α), α={a:g}",
                        line=dict(color="#cf222e", dash="dash"), visible=i == len(alphas) // 2)
    steps = [dict(label=f"{a:g}", method="update",
                  args=[{"visible": [True] * n + [j == i for j in range(len(alphas))]}]) for i, a in enumerate(alphas)]
    fig.update_layout(title=title, height=400, xaxis_title="round i", yaxis_title="log E_i",
                      sliders=[dict(active=len(alphas) // 2, currentvalue=dict(prefix="α = "), steps=steps)])
    return fig
