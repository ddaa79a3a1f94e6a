"""The RIP percentile explorer: three sliders set the percentiles of the rejected reward (m1), the
rejected length (m2) and the reward gap (m3); the panel shows the kept-set size, its share of each
prompt kind, and the pool as a scatter of rejected reward vs gap colored by kind with the filter's
box (m1 ≥ τ1, m3 ≤ τ3; hover shows m2). `percentile_figure` is the precomputed view for the report.

It takes any `lab.align.rip.Pool` and per-prompt labels: for a real pool without known kinds pass a
single label and read the sizes only.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
import torch

from lab.align import rip
from lab.widgets.figures import show_in


def scatter_figure(pool: rip.Pool, kind: torch.Tensor, names: Sequence[str], tau: tuple[float, float, float], *,
                   title: str) -> go.Figure:
    """Valid pairs as points (rejected reward, gap), one trace per kind, the kept box drawn."""
    fig = go.Figure()
    v = pool.valid
    for k, name in enumerate(names):
        m = v & (kind == k)
        fig.add_scatter(x=pool.m1[m].tolist(), y=pool.m3[m].tolist(), mode="markers", name=name,
                        marker=dict(size=6, opacity=0.6), customdata=pool.m2[m].tolist(),
                        hovertemplate="rejected reward %{x:.2f}, gap %{y:.2f}, rejected length %{customdata}"
                                      "<extra>" + name + "</extra>")
    t1, _, t3 = tau
    fig.add_shape(type="rect", x0=t1, x1=1.02, y0=-0.02, y1=t3, line=dict(color="black", width=2, dash="dot"))
    fig.update_layout(title=title, height=420, xaxis_title="rejected reward m1", yaxis_title="reward gap m3")
    return fig


def kept_stats(pool: rip.Pool, kind: torch.Tensor, names: Sequence[str], q: tuple[float, float, float]) -> dict:
    """Kept size and per-kind share of the kept set for percentiles q."""
    tau = rip.thresholds(pool, q)
    kept = rip.keep(pool, tau)
    share = {name: ((kind == k) & kept).sum().item() / max(1, kept.sum().item()) for k, name in enumerate(names)}
    return {"tau": tau, "kept": int(kept.sum()), "valid": int(pool.valid.sum()), "share": share}


def percentile_explorer(pool: rip.Pool, kind: torch.Tensor, names: Sequence[str]):
    """Live panel: sliders q1, q2, q3 (percent). Test hooks: `.figure`, `.readout`, `.stats`, `.controls`."""
    import ipywidgets as w

    sliders = {name: w.IntSlider(value=50, min=0, max=100, step=5, description=name)
               for name in ("m1 (rej. reward) ≥ q", "m2 (rej. length) ≥ q", "m3 (gap) ≤ q")}
    readout, out = w.HTML(), w.Output()
    readout.add_class("lab-readout")
    box = w.VBox([w.HBox(list(sliders.values())), readout, out])
    box.add_class("lab-explorer")

    def update(_=None):
        q = tuple(s.value / 100 for s in sliders.values())
        st = kept_stats(pool, kind, names, q)
        box.stats = st
        box.figure = scatter_figure(pool, kind, names, st["tau"], title=f"kept {st['kept']} of {st['valid']} "
                                    f"valid prompts (box: m1 ≥ {st['tau'][0]:.2f}, m3 ≤ {st['tau'][2]:.2f}; "
                                    f"m2 ≥ {st['tau'][1]:g} not drawn)")
        readout.value = (f"τ = ({st['tau'][0]:.3f}, {st['tau'][1]:g}, {st['tau'][2]:.3f}); kept <b>{st['kept']}</b> of "
                         f"{st['valid']}; kept set: " + ", ".join(f"{n} {v:.1%}" for n, v in st["share"].items()))
        show_in(out, box.figure)

    for s in sliders.values():
        s.observe(update, "value")
    box.controls, box.readout = list(sliders.values()), readout
    update()
    return box


def percentile_figure(pool: rip.Pool, kind: torch.Tensor, names: Sequence[str], bad: Sequence[int],
                      qs: Sequence[float] = (0.25, 0.5, 0.75)) -> go.Figure:
    """Precomputed view: the same percentile q for all three metrics (the paper's 25/50/75 sweep); the
    kept size and the share of the `bad` kinds in it, for each q in `qs`."""
    sizes, shares = [], []
    for q in qs:
        st = kept_stats(pool, kind, names, (q, q, q))
        sizes.append(st["kept"])
        shares.append(sum(st["share"][names[k]] for k in bad))
    fig = go.Figure()
    fig.add_bar(x=[f"{q:.0%}" for q in qs], y=shares, name="low-quality share of the kept set",
                text=[f"{s:.1%} of {n}" for s, n in zip(shares, sizes)], textposition="outside")
    fig.update_layout(title="RIP at a common percentile q (m1 ≥ q, m2 ≥ q, m3 ≤ q)", height=360,
                      yaxis_title="low-quality share", xaxis_title="percentile q", yaxis_range=[0, 1])
    return fig
