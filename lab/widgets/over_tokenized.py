"""Over-tokenized table-size explorer: for a table size m, n-gram order n and slices k, the parameters the
n-gram tables cost (≈ m·D), how many of the n-grams seen share a row (and how many of those end in the same
token, which the 1-gram embedding cannot tell apart), and the held-out excess loss where that setting was trained.

`size_figure` is the precomputed view for the report (a dropdown over (n, k), collision rates vs log10 m beside
the trained excess losses); `size_explorer` is the live panel (m, n, k).
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lab.widgets.figures import show_in


def _shapes(table: list[dict]) -> list[tuple[int, int]]:
    return sorted({(r["n"], r["k"]) for r in table})


def size_figure(table: list[dict], trained: dict[str, dict], *, title: str = "") -> go.Figure:
    """Left: share of n-grams sharing a row (solid) and of colliding pairs with the same last token (dotted) vs
    log10 m, one (n, k) at a time (dropdown). Right: held-out excess loss of the trained runs (`trained`: name →
    {"m", "n", "k", "excess"}) vs log10 m. Works offline."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["collisions among the n-grams seen", "trained: excess loss"])
    shapes = _shapes(table)
    for i, (n, k) in enumerate(shapes):
        rows = sorted((r for r in table if (r["n"], r["k"]) == (n, k)), key=lambda r: r["m"])
        lx = [math.log10(r["m"]) for r in rows]
        text = [f"m={r['m']}, {r['params']:,} params" for r in rows]
        fig.add_scatter(x=lx, y=[r["rate"] for r in rows], text=text, name="share sharing a row", mode="lines+markers",
                        visible=i == 0, line=dict(color="#4C78A8"), row=1, col=1)
        fig.add_scatter(x=lx, y=[r["same_last"] for r in rows], text=text, name="same last token", mode="lines+markers",
                        visible=i == 0, line=dict(color="#E45756", dash="dot"), row=1, col=1)
    for name, r in trained.items():
        fig.add_scatter(x=[math.log10(r["m"])], y=[r["excess"]], name=name, mode="markers+text", text=[name],
                        textposition="top center", marker=dict(size=9), showlegend=False, row=1, col=2)
    n_tr = len(trained)
    buttons = [dict(label=f"n={n}, k={k}", method="update",
                    args=[{"visible": [j // 2 == i for j in range(2 * len(shapes))] + [True] * n_tr}])
               for i, (n, k) in enumerate(shapes)]
    fig.update_xaxes(title_text="log10 m")
    fig.update_yaxes(range=[-0.02, 1.02], row=1, col=1)
    fig.update_layout(title=title, height=430, updatemenus=[dict(buttons=buttons, x=0, y=1.18, xanchor="left")])
    return fig


def summary(table: list[dict], trained: dict[str, dict], m: int, n: int, k: int) -> dict:
    """The table's row for (m, n, k) and the trained excess loss at that setting (None when not trained)."""
    row = next(r for r in table if (r["m"], r["n"], r["k"]) == (m, n, k))
    hit = [r["excess"] for r in trained.values() if (r["m"], r["n"], r["k"]) == (m, n, k) and r.get("unigram", True)]
    return {**row, "excess": hit[0] if hit else None}


def size_explorer(table: list[dict], trained: dict[str, dict], *, m: int | None = None):
    """Live panel: m, n, k → parameters, collision shares and (where trained) excess loss. Hooks: `.summary`
    (the numbers shown), `.figure`, `.controls`."""
    import ipywidgets as w

    ms = sorted({r["m"] for r in table})
    shapes = _shapes(table)
    ms_ = w.SelectionSlider(options=ms, value=m if m in ms else ms[-1], description="m")
    nn = w.Dropdown(options=sorted({n for n, _ in shapes}), description="n")
    kk = w.Dropdown(options=sorted({k for _, k in shapes}), description="k")
    info, out = w.HTML(), w.Output()
    box = w.VBox([w.HBox([ms_, nn, kk]), info, out])
    box.add_class("lab-explorer")

    def update(_=None):
        if (nn.value, kk.value) not in shapes:
            info.value = f"<i>n={nn.value}, k={kk.value} is not in the table; pick one of {shapes}</i>"
            return
        s = box.summary = summary(table, trained, ms_.value, nn.value, kk.value)
        loss = "not trained here" if s["excess"] is None else f"{s['excess']:.3f} nats"
        info.value = (f"<b>m={s['m']}, n={s['n']}, k={s['k']}</b>: {s['params']:,} OE parameters; "
                      f"{100 * s['rate']:.1f}% of the n-grams seen share a row, {100 * s['same_last']:.1f}% of "
                      f"colliding pairs end in the same token; held-out excess loss: {loss}")
        box.figure = size_figure([r for r in table if (r["n"], r["k"]) == (nn.value, kk.value)], trained,
                                 title=f"n={nn.value}, k={kk.value}")
        box.figure.add_vline(x=math.log10(ms_.value), line_dash="dash", line_color="#54A24B", row=1, col=1)
        show_in(out, box.figure)

    for c in (ms_, nn, kk):
        c.observe(update, "value")
    box.controls = [ms_, nn, kk]
    update()
    return box
