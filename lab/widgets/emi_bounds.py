"""The EMI-bounds explorer: the shift grid as heat maps (EMI, EMID, the bound, the preference proxy),
EMID vs the bound as a scatter with Pearson r and p, a scenario picker showing example queries with
the model's and the reference responses, and the bound's decomposition into its JSD terms with an
entropy-scale control (Ĥ; off = the repo's scale-adjusted form).

Input: `grid[(visual, textual)] = {"emi", "rp", "jsd": (v, t, py, qy), "examples": [(question, reference,
response[, image]), ...]}` over any scenario labels — the toy's 7 × 5 grid or a real model's scenarios;
an example's optional image (3, H, W, RGB in [0, 1]) is drawn beside its text, enlarged (the toy's are
8 × 8). The ID scenario is `grid`'s first key. `grid_figure`, `scatter_figure` and `images_figure` are
the precomputed views.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import plotly.graph_objects as go
import torch

from lab.core.stats import pearson
from lab.interp.emi import bound_terms, emid, upper_bound
from lab.widgets.figures import show_in

METRICS = ("EMI", "EMID", "bound", "RP")


def derived(grid: dict, entropy_scale: float | None = None) -> dict:
    """Per scenario: EMI, EMID (vs the first scenario, ID), the bound (scale-adjusted or entropy-scaled), RP."""
    keys = list(grid)
    id_emi = grid[keys[0]]["emi"]
    return {k: {"EMI": v["emi"], "EMID": emid(id_emi, v["emi"]), "RP": v["rp"],
                "bound": upper_bound(*v["jsd"], entropy_scale=entropy_scale)} for k, v in grid.items()}


def grid_figure(grid: dict, rows: Sequence, cols: Sequence, metric: str = "EMI",
                entropy_scale: float | None = None) -> go.Figure:
    """One metric over the visual (rows) × textual (columns) grid."""
    d = derived(grid, entropy_scale)
    z = [[d[r, c][metric] for c in cols] for r in rows]
    fig = go.Figure(go.Heatmap(z=z, x=[_label(c) for c in cols], y=[_label(r) for r in rows], colorscale="RdBu",
                               texttemplate="%{z:.2f}", hovertemplate="%{y} × %{x}: %{z:.3f}<extra></extra>"))
    fig.update_layout(title=f"{metric} over the shift grid (rows: visual, columns: textual)", height=420)
    fig.update_yaxes(autorange="reversed")
    return fig


def scatter_figure(grid: dict, entropy_scale: float | None = None) -> tuple[go.Figure, float, float]:
    """EMID vs the bound over the shifted scenarios, with Pearson r and its p-value."""
    d = derived(grid, entropy_scale)
    keys = list(grid)[1:]
    x, y = torch.tensor([d[k]["bound"] for k in keys]), torch.tensor([d[k]["EMID"] for k in keys])
    r, p = pearson(x, y)
    fig = go.Figure(go.Scatter(x=x.tolist(), y=y.tolist(), mode="markers", text=[f"{_label(a)} × {_label(b)}"
                                                                                  for a, b in keys],
                               hovertemplate="%{text}: bound %{x:.3f}, EMID %{y:.3f}<extra></extra>"))
    form = "scale-adjusted" if entropy_scale is None else f"entropy-scaled, Ĥ = {entropy_scale:g}"
    fig.update_layout(title=f"EMID vs its bound ({form}): Pearson r = {r:.3f}, p = {p:.2g}", height=380,
                      xaxis_title="bound", yaxis_title="EMID (ID − OOD)")
    return fig, r, p


def image_html(img, *, px: int = 6) -> str:
    """A small RGB image (3, H, W), clipped to [0, 1], as an inline SVG of `px`-sized pixels (no kernel,
    no image library: it stays visible in the static report)."""
    rgb = (torch.as_tensor(img, dtype=torch.float).clamp(0, 1) * 255).round().int().permute(1, 2, 0)  # (H, W, 3)
    H, W, _ = rgb.shape
    cells = "".join(f'<rect x="{x * px}" y="{y * px}" width="{px}" height="{px}" fill="rgb({r},{g},{b})"/>'
                    for y in range(H) for x in range(W) for r, g, b in [rgb[y, x].tolist()])
    return f'<svg width="{W * px}" height="{H * px}" shape-rendering="crispEdges">{cells}</svg>'


def images_figure(grid: dict, rows: Sequence, *, column=None, n_examples: int = 4) -> go.Figure:
    """The first `n_examples` images of each visual shift (rows of the grid, at textual `column`, default
    the first), as one figure: what the model sees as the visual shift grows."""
    from plotly.subplots import make_subplots

    column = column if column is not None else next(iter(grid))[1]
    fig = make_subplots(rows=n_examples, cols=len(rows), column_titles=[_label(r) for r in rows],
                        horizontal_spacing=0.01, vertical_spacing=0.02)
    for j, r in enumerate(rows):
        for i, example in enumerate(grid[r, column]["examples"][:n_examples]):
            img = torch.as_tensor(example[3], dtype=torch.float).clamp(0, 1).permute(1, 2, 0) * 255
            fig.add_trace(go.Image(z=img.round().tolist(), hoverinfo="skip"), row=i + 1, col=j + 1)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.update_layout(title="the same objects under each visual shift (8 × 8 pixels)", height=110 * n_examples + 60,
                      margin=dict(l=10, r=10, t=70, b=10))
    return fig


def _label(key) -> str:
    return key if isinstance(key, str) else (key[0] if key[1] in (0, None) else f"{key[0]} {key[1]}")


def emi_explorer(grid: dict, rows: Sequence, cols: Sequence, *, n_examples: int = 4):
    """Live panel. Test hooks: `.heatmap`, `.scatter`, `.bars`, `.readout`, `.r`, `.controls`."""
    import ipywidgets as w

    metric = w.Dropdown(options=list(METRICS), description="heat map")
    vis = w.Dropdown(options=[(_label(r), i) for i, r in enumerate(rows)], description="visual")
    txt = w.Dropdown(options=[(_label(c), i) for i, c in enumerate(cols)], description="textual")
    scaled = w.Checkbox(value=False, description="entropy-scaled bound")
    h_hat = w.FloatSlider(value=1.0, min=0.1, max=5.0, step=0.1, description="Ĥ")
    readout, out_map, out_scatter, out_bars = w.HTML(), w.Output(), w.Output(), w.Output()
    readout.add_class("lab-readout")
    box = w.VBox([w.HBox([metric, scaled, h_hat]), w.HBox([out_map, out_scatter]), w.HBox([vis, txt]), readout,
                  out_bars])
    box.add_class("lab-explorer")

    def update(_=None):
        hs = h_hat.value if scaled.value else None
        box.heatmap = grid_figure(grid, rows, cols, metric.value, hs)
        box.scatter, box.r, box.p = scatter_figure(grid, hs)
        key = (rows[vis.value], cols[txt.value])
        cell, d = grid[key], derived(grid, hs)[key]
        terms = bound_terms(*cell["jsd"])
        box.bars = go.Figure(go.Bar(x=list(terms), y=list(terms.values())))
        box.bars.update_layout(title=f"{_label(key[0])} × {_label(key[1])}: the bound's terms", height=300)
        rows_html = "".join("<tr>" + (f"<td>{image_html(ex[3])}</td>" if len(ex) > 3 else "")
                            + "".join(f"<td>{html.escape(' '.join(part))}</td>" for part in ex[:3]) + "</tr>"
                            for ex in cell["examples"][:n_examples])
        has_image = any(len(ex) > 3 for ex in cell["examples"][:n_examples])
        readout.value = (f"EMI {d['EMI']:.3f}, EMID {d['EMID']:.3f}, bound {d['bound']:.3f}, RP {d['RP']:.3f}"
                         "<table><tr>" + ("<th>image</th>" if has_image else "")
                         + "<th>question</th><th>reference</th><th>model</th></tr>" + rows_html + "</table>")
        show_in(out_map, box.heatmap)
        show_in(out_scatter, box.scatter)
        show_in(out_bars, box.bars)

    for c in (metric, vis, txt, scaled, h_hat):
        c.observe(update, "value")
    box.controls = {"metric": metric, "visual": vis, "textual": txt, "scaled": scaled, "h_hat": h_hat}
    box.readout = readout
    update()
    return box
