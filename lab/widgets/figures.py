"""Plotly figures shared by notebooks and explorers. Each returns a `go.Figure`; nothing is shown."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import plotly.graph_objects as go


def curve(y: Sequence[float], *, title: str, xlabel: str = "step", ylabel: str = "", log_y: bool = False,
          smooth: int = 1) -> go.Figure:
    """A line plot (optionally a running mean over `smooth` points)."""
    y = list(y)
    if smooth > 1:
        y = [sum(y[max(0, i - smooth + 1):i + 1]) / len(y[max(0, i - smooth + 1):i + 1]) for i in range(len(y))]
    fig = go.Figure(go.Scatter(y=y, mode="lines"))
    fig.update_layout(title=title, xaxis_title=xlabel, yaxis_title=ylabel, height=320, margin=dict(t=50, b=40))
    if log_y:
        fig.update_yaxes(type="log")
    return fig


def lines(x: Sequence, ys: dict[str, Sequence[float]], *, title: str, xlabel: str = "", ylabel: str = "",
          dash: Callable[[str], bool] | None = None, log_y: bool = False) -> go.Figure:
    """Several named curves over the same x (`dash(name)` True draws that one dashed)."""
    fig = go.Figure()
    for name, y in ys.items():
        fig.add_scatter(x=list(x), y=list(y), mode="lines+markers", name=name,
                        line=dict(dash="dash" if dash and dash(name) else "solid"))
    fig.update_layout(title=title, xaxis_title=xlabel, yaxis_title=ylabel, height=360, margin=dict(t=50, b=40))
    if log_y:
        fig.update_yaxes(type="log")
    return fig


def heatmap(z, *, x: Sequence[str], y: Sequence[str], title: str, zmin: float | None = 0.0,
            zmax: float | None = None, fmt: str = ".2f") -> go.Figure:
    """An annotated heat map of a small matrix `z` (rows `y`, columns `x`)."""
    z = z.tolist() if hasattr(z, "tolist") else z
    fig = go.Figure(go.Heatmap(z=z, x=list(x), y=list(y), zmin=zmin, zmax=zmax, colorscale="Blues",
                               texttemplate=f"%{{z:{fmt}}}", hovertemplate="%{y}, %{x}: %{z:.3f}<extra></extra>"))
    fig.update_layout(title=title, height=120 + 40 * len(y), margin=dict(t=50, b=40))
    fig.update_yaxes(autorange="reversed")
    return fig


def show_in(out, fig: go.Figure) -> None:
    """Put a plotly figure into an ipywidgets `Output` by setting its state (no output capture, no
    `clear_output`): JupyterLab renders the plotly mimetype live, the saved widget state carries it
    into reports, and it works outside a kernel (tests)."""
    import json

    out.outputs = ({"output_type": "display_data", "metadata": {},
                    "data": {"application/vnd.plotly.v1+json": json.loads(fig.to_json()), "text/plain": "<Figure>"}},)
