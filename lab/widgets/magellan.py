"""MAGELLAN explorers: competence per goal family over training, true (solid) vs the estimator's (dashed), for
each recorded run keyed by (goal-space size, delay N); and the estimator's goal embeddings h(g) in 2-D (PCA)
coloured by the hidden family (the paper's Q3 / README animation).

`competence_figure` is the precomputed view for the report (a dropdown over runs); `competence_explorer` the
live panel (size and delay selectors); `embedding_figure` the 2-D map.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from lab.agents.little_zoo import FAMILIES
from lab.widgets.figures import show_in

COLORS = ("#4C78A8", "#54A24B", "#F58518", "#E45756", "#9D755D")


def _traces(res: dict, visible: bool = True) -> list[go.Scatter]:
    """Four true curves and four estimated ones (the feasible families) of one MAGELLAN run."""
    comp, est = np.asarray(res["competence"]), res.get("estimated", {})
    out = []
    for f in range(4):
        out.append(go.Scatter(x=list(range(len(comp))), y=comp[:, f].tolist(), name=f"{FAMILIES[f]} (true)",
                              line=dict(color=COLORS[f]), visible=visible))
        out.append(go.Scatter(x=list(est), y=[float(v[f]) for v in est.values()], name=f"{FAMILIES[f]} (estimated)",
                              line=dict(color=COLORS[f], dash="dash"), visible=visible))
    return out


def competence_figure(runs: dict[tuple[int, int], dict], *, title: str = "") -> go.Figure:
    """Precomputed view: one dropdown entry per run key (n_goals, N); 8 traces each. Works offline."""
    keys = list(runs)
    fig = go.Figure()
    for i, k in enumerate(keys):
        for tr in _traces(runs[k], visible=i == 0):
            fig.add_trace(tr)
    buttons = [dict(label=f"{k[0]:,} goals, N = {k[1]}", method="update",
                    args=[{"visible": [j // 8 == i for j in range(8 * len(keys))]}]) for i, k in enumerate(keys)]
    fig.update_layout(title=title, height=420, xaxis_title="round (sampler update)", yaxis_title="competence",
                      yaxis_range=[-0.02, 1.02], updatemenus=[dict(buttons=buttons, x=1.0, y=1.15)] if len(keys) > 1
                      else [])
    return fig


def competence_explorer(runs: dict[tuple[int, int], dict]):
    """Live panel: goal-space size and delay N among the recorded runs. Hooks: `.figure`, `.key`, `.controls`."""
    import ipywidgets as w

    sizes = sorted({k[0] for k in runs})
    delays = sorted({k[1] for k in runs})
    size = w.Dropdown(options=sizes, value=sizes[-1] if len(sizes) == 1 else sizes[0], description="goals")
    delay = w.Dropdown(options=delays, value=max(delays), description="delay N")
    out = w.Output()
    box = w.VBox([w.HBox([size, delay]), out])
    box.add_class("lab-explorer")

    def update(_=None):
        box.key = (size.value, delay.value)
        if box.key not in runs:
            box.figure = go.Figure().update_layout(title=f"no run recorded for {box.key[0]:,} goals, N = {box.key[1]}")
        else:
            box.figure = competence_figure({box.key: runs[box.key]},
                                           title=f"{box.key[0]:,} goals, N = {box.key[1]}: true vs estimated")
        show_in(out, box.figure)

    for c in (size, delay):
        c.observe(update, "value")
    box.controls = [size, delay]
    update()
    return box


def embedding_figure(emb: np.ndarray, family: np.ndarray, *, n: int = 3000, seed: int = 0,
                     title: str = "") -> go.Figure:
    """h(g) projected on its first two principal components (sklearn PCA), one colour per family; at most `n`
    goals drawn (all goals of the small families are kept)."""
    from sklearn.decomposition import PCA

    rng = np.random.default_rng(seed)
    keep = np.concatenate([np.flatnonzero(family == f) if (family == f).sum() <= n // 5 else
                           rng.choice(np.flatnonzero(family == f), n // 5, replace=False)
                           for f in range(len(FAMILIES)) if (family == f).any()])
    xy = PCA(2, random_state=seed).fit_transform(np.asarray(emb, dtype=float)[keep])
    fig = go.Figure()
    for f in range(len(FAMILIES)):
        m = family[keep] == f
        fig.add_scatter(x=xy[m, 0].tolist(), y=xy[m, 1].tolist(), mode="markers", name=FAMILIES[f],
                        marker=dict(color=COLORS[f], size=5, opacity=0.6))
    fig.update_layout(title=title, height=440, xaxis_title="PC 1", yaxis_title="PC 2")
    return fig
