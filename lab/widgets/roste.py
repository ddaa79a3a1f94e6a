"""RoSTE activation-outlier explorer: per layer and per quantized input (q/k/v, o, gate/up, down, the key cache),
the mean |activation| of every channel under each rotation configuration, and the calibration quantization
error (Eq. 12, MSE) that RoSTE's selection compares for R2, R3 and R4.

Data: `passes` maps a configuration's name to `lab.compress.roste.layer_errors(...)` (a list over layers of
{"R2", "R3", "R4", "total", "channels": {input: [mean |x| per channel]}}). `outlier_figure` is the precomputed
view for the report (a dropdown over layer × input); `error_figure` the per-layer errors with / without each
rotation and the choice; `outlier_explorer` the live panel.
"""

from __future__ import annotations

import plotly.graph_objects as go

from lab.widgets.figures import show_in

COLORS = ("#9D755D", "#4C78A8", "#F58518", "#54A24B", "#B279A2")


def _traces(passes: dict[str, list[dict]], layer: int, inp: str) -> list[go.Bar]:
    return [go.Bar(y=p[layer]["channels"][inp], name=name, marker_color=COLORS[i % len(COLORS)],
                   hovertemplate=name + " ch %{x}: %{y:.3g}<extra></extra>")
            for i, (name, p) in enumerate(passes.items())]


def inputs(passes: dict[str, list[dict]]) -> list[str]:
    return list(next(iter(passes.values()))[0]["channels"])


def peaks(passes: dict[str, list[dict]]) -> dict[str, list[dict[str, float]]]:
    """Max / median of the mean |activation| per channel: {configuration: [{input: ratio} per layer]}."""
    import numpy as np

    return {k: [{i: float(np.max(c) / max(np.median(c), 1e-12)) for i, c in layer["channels"].items()} for layer in p]
            for k, p in passes.items()}


def channel_figure(passes: dict[str, list[dict]], layer: int = 0, inp: str = "q", *, log: bool = True,
                   title: str = "") -> go.Figure:
    """Mean |x| per channel of one layer's input `inp`, one bar series per configuration."""
    fig = go.Figure(_traces(passes, layer, inp))
    fig.update_layout(title=title or f"layer {layer}, input of {inp}: mean |activation| per channel",
                      barmode="group", xaxis_title="channel", yaxis_title="mean |x|", yaxis_type="log" if log else
                      "linear", height=380)
    return fig


def outlier_figure(passes: dict[str, list[dict]], *, title: str = "") -> go.Figure:
    """Every (layer, input) precomputed; a dropdown picks one (works offline in the report)."""
    L, ins = len(next(iter(passes.values()))), inputs(passes)
    combos = [(l, i) for l in range(L) for i in ins]
    n = len(passes)
    fig = go.Figure()
    for k, (l, i) in enumerate(combos):
        for t in _traces(passes, l, i):
            t.visible = k == 0
            t.showlegend = True
            fig.add_trace(t)
    buttons = [dict(label=f"layer {l} · {i}", method="update",
                    args=[{"visible": [c == k for c in range(len(combos)) for _ in range(n)]},
                          {"title": f"{title} — layer {l}, input of {i}"}]) for k, (l, i) in enumerate(combos)]
    fig.update_layout(title=f"{title} — layer {combos[0][0]}, input of {combos[0][1]}", barmode="group",
                      xaxis_title="channel", yaxis_title="mean |x| (log)", yaxis_type="log", height=420,
                      updatemenus=[dict(buttons=buttons, x=1.0, xanchor="right", y=1.18)])
    return fig


def error_figure(search: dict, *, title: str = "calibration quantization error per layer and rotation") -> go.Figure:
    """Eq. 12 (MSE) attributed to R2/R3/R4 per layer, all off vs all on; the chosen option marked ★."""
    xs = [f"L{l} {k}" for l in range(len(search["off"])) for k in ("R2", "R3", "R4")]
    val = lambda p: [search[p][l][k] for l in range(len(search[p])) for k in ("R2", "R3", "R4")]
    pick = ["★ H" if search["choice"][l][k] else "★ I" for l in range(len(search["off"])) for k in ("R2", "R3", "R4")]
    fig = go.Figure([go.Bar(x=xs, y=val("off"), name="I (off)", marker_color=COLORS[0]),
                     go.Bar(x=xs, y=val("on"), name="H (on)", marker_color=COLORS[1], text=pick,
                            textposition="outside")])
    fig.update_layout(title=title, barmode="group", yaxis_title="MSE (weight + input, or cache)", height=400)
    return fig


def outlier_explorer(passes: dict[str, list[dict]], search: dict | None = None):
    """Live panel: layer, input, log scale. Hooks: `.figure`, `.peak` ({configuration: max/median channel}),
    `.controls`."""
    import ipywidgets as w

    L = len(next(iter(passes.values())))
    layer = w.Dropdown(options=[(f"layer {l}", l) for l in range(L)], description="layer")
    inp = w.Dropdown(options=inputs(passes), description="input")
    log = w.Checkbox(value=True, description="log scale")
    out, info = w.Output(), w.HTML()
    box = w.VBox([w.HBox([layer, inp, log]), info, out])
    box.add_class("lab-explorer")

    def update(_=None):
        box.peak = {k: p[layer.value][inp.value] for k, p in peaks(passes).items()}
        errs = "" if search is None else " · ".join(
            f"{k}: I {search['off'][layer.value][k]:.3g} / H {search['on'][layer.value][k]:.3g} → "
            f"{'H' if search['choice'][layer.value][k] else 'I'}" for k in ("R2", "R3", "R4"))
        info.value = ("max/median channel: " + ", ".join(f"{k} {v:.1f}" for k, v in box.peak.items())
                      + (f"<br>layer errors {errs}" if errs else ""))
        box.figure = channel_figure(passes, layer.value, inp.value, log=log.value)
        show_in(out, box.figure)

    for c in (layer, inp, log):
        c.observe(update, "value")
    box.controls = [layer, inp, log]
    update()
    return box
