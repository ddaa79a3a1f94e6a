"""BanditSpec explorers: generated text with each token coloured by the arm that drafted it (accepted) or by the
target (bonus token), an arm-pull timeline per prompt, and the stopping-time regret against log(len).

`token_html` and `timeline_figure` take decoding traces (`banditspec_decode.Trace`); `timeline_figure` is the
precomputed view for the report (buttons switch the policy); `spec_explorer` is the live panel (policy, prompt).
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from lab.widgets.figures import show_in

COLORS = ("#4C78A8", "#F58518", "#54A24B", "#B279A2", "#E45756", "#72B7B2")
TARGET_COLOR = "#BBBBBB"


def token_html(tokens: Sequence[int], source: Sequence[int], arms: Sequence[str], words: Sequence[str] | None = None,
               *, width: int = 32) -> str:
    """HTML: one box per generated token, filled with the drafting arm's colour, grey for target bonus tokens."""
    legend = " ".join(f'<span style="background:{COLORS[i % 6]};color:white;padding:1px 4px">{html.escape(a)}</span>'
                      for i, a in enumerate(arms))
    legend += f' <span style="background:{TARGET_COLOR};padding:1px 4px">target (bonus / correction)</span>'
    cells = []
    for k, (t, s) in enumerate(zip(tokens, source)):
        text = html.escape(words[t] if words is not None else str(t))
        color, fg = (COLORS[s % 6], "white") if s >= 0 else (TARGET_COLOR, "black")
        cells.append(f'<span title="#{k}" style="display:inline-block;min-width:{width}px;margin:1px;padding:1px 2px;'
                     f'background:{color};color:{fg};font:11px monospace;text-align:center">{text}</span>')
    return f'<div style="line-height:1.9">{legend}<br>{"".join(cells)}</div>'


def timeline_figure(traces: dict[str, list], arms: Sequence[str], labels: Sequence[str], *,
                    title: str = "arm pulled in each round, per prompt") -> go.Figure:
    """Heat map (prompt × round) of the arm pulled, one trace per policy, buttons to switch (works offline)."""
    fig = go.Figure()
    K = len(arms)
    scale = [[v, COLORS[int(min(v * K, K - 1e-9))]] for v in np.linspace(0, 1, 2 * K)]
    for j, (pol, trs) in enumerate(traces.items()):
        R = max(t.rounds for t in trs)
        z = np.full((len(trs), R), np.nan)
        for i, t in enumerate(trs):
            z[i, : t.rounds] = t.arms
        fig.add_heatmap(z=z, y=list(labels), x=list(range(1, R + 1)), zmin=-0.5, zmax=K - 0.5, colorscale=scale,
                        visible=j == 0, name=pol, colorbar=dict(tickvals=list(range(K)), ticktext=list(arms)),
                        hovertemplate="%{y}, round %{x}: arm %{z}<extra></extra>")
    buttons = [dict(label=pol, method="update", args=[{"visible": [k == j for k in range(len(traces))]}])
               for j, pol in enumerate(traces)]
    fig.update_layout(title=title, xaxis_title="round (target call)", height=140 + 22 * len(labels),
                      updatemenus=[dict(buttons=buttons, direction="right", x=0, y=1.18, xanchor="left")],
                      margin=dict(t=90))
    fig.update_yaxes(autorange="reversed")
    return fig


def regret_figure(curves: dict[str, np.ndarray], lens: Sequence[int], slope: float, *,
                  title: str = "stopping-time regret vs output length") -> go.Figure:
    """Mean regret per policy (± 2 s.e.) on a log-x axis, and the Thm 4.4 lower-bound line slope · log(len)."""
    fig = go.Figure()
    for i, (name, y) in enumerate((k, v) for k, v in curves.items() if not k.startswith(("sem", "ST"))):
        sem = curves.get(f"sem {name}", np.zeros_like(y))
        fig.add_scatter(x=list(lens), y=y, name=name, mode="lines+markers", line=dict(color=COLORS[i % 6]),
                        error_y=dict(type="data", array=2 * sem, visible=True))
    fig.add_scatter(x=list(lens), y=[slope * np.log(n) for n in lens], name=f"lower bound {slope:.2f}·log len",
                    mode="lines", line=dict(dash="dot", color="black"))
    fig.update_layout(title=title, xaxis_type="log", xaxis_title="output length len (tokens)",
                      yaxis_title="E[ST(ALG)] − E[ST(best arm)]", yaxis_type="log", height=420)
    return fig


def spec_explorer(traces: dict[str, list], arms: Sequence[str], labels: Sequence[str],
                  words: Sequence[str] | None = None):
    """Live panel: pick a policy and a prompt; the coloured text and that prompt's arm pulls per round."""
    import ipywidgets as w

    policy = w.Dropdown(options=list(traces), description="policy")
    prompt = w.Dropdown(options=[(lab, i) for i, lab in enumerate(labels)], description="prompt")
    text, stats, out = w.HTML(), w.HTML(), w.Output()

    def update(_=None):
        t = traces[policy.value][prompt.value]
        text.value = token_html(t.tokens, t.source, arms, words)
        stats.value = (f"<b>{t.rounds}</b> target calls for {len(t.tokens)} tokens, MAT {t.mat:.2f}; pulls: "
                       + ", ".join(f"{a} {t.arms.count(i)}" for i, a in enumerate(arms)))
        fig = go.Figure(go.Scatter(x=list(range(1, t.rounds + 1)), y=[arms[a] for a in t.arms], mode="markers",
                                   marker=dict(color=[COLORS[a % 6] for a in t.arms], size=np.add(t.accepted, 4))))
        fig.update_layout(title="arm per round (marker size: accepted drafts)", height=260, xaxis_title="round")
        show_in(out, fig)

    policy.observe(update, "value")
    prompt.observe(update, "value")
    update()
    return w.VBox([w.HBox([policy, prompt]), stats, text, out])
