"""FloE explorers: activation histograms per (layer, expert) with the Eq. 6 threshold, and the offload
panel (PCIe bandwidth, kept fraction, device budget for experts -> bytes/token, tokens/s and a
compute-vs-transfer timeline). `histogram_figure`, `timeline_figure` and `bytes_figure` are the precomputed
views for the report.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import plotly.graph_objects as go
import torch

from lab.moe.links import Span
from lab.widgets.figures import show_in

COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D"]


def histogram_figure(acts: dict[tuple[int, int], dict[str, torch.Tensor]], k: float = 0.8, bins: int = 60) -> go.Figure:
    """|a_gate|, |a_up|, |a_down| histograms; a dropdown picks the (layer, expert); dotted lines mark each
    activation's per-expert threshold at sparsity k (Eq. 6)."""
    fig, keys = go.Figure(), list(acts)
    for i, key in enumerate(keys):
        for j, (name, a) in enumerate(acts[key].items()):
            v = a.abs().flatten().float()
            hi = float(torch.quantile(v, 0.995)) or 1.0
            h = torch.histc(v.clamp(max=hi), bins, 0, hi) / v.numel()  # binned here: the report stays small
            fig.add_bar(x=(torch.arange(bins) + 0.5).mul(hi / bins).tolist(), y=h.tolist(), name=f"|a_{name}|",
                        visible=i == 0, opacity=0.6, marker_color=COLORS[j])
    thresholds = {key: [float(torch.quantile(a.abs().flatten().float(), k)) for a in acts[key].values()]
                  for key in keys}

    def shapes(key):
        return [dict(type="line", x0=t, x1=t, y0=0, y1=1, yref="paper", line=dict(dash="dot", color=COLORS[j]))
                for j, t in enumerate(thresholds[key])]

    n = len(next(iter(acts.values())))
    buttons = [dict(label=f"layer {l}, expert {e}", method="update",
                    args=[{"visible": [i == b for i in range(len(keys)) for _ in range(n)]},
                          {"shapes": shapes((l, e))}]) for b, (l, e) in enumerate(keys)]
    fig.update_layout(barmode="overlay", height=380, shapes=shapes(keys[0]), xaxis_title="|activation|",
                      yaxis_title="share of (token, neuron)", updatemenus=[dict(buttons=buttons, x=1.0, y=1.18)],
                      title=f"activation magnitudes; dotted: per-expert threshold at k = {k:g}")
    return fig


def activation_explorer(acts: dict[tuple[int, int], dict[str, torch.Tensor]]):
    """Live panel: (layer, expert) dropdown and a sparsity slider over the histograms. Hooks: `.figure`, `.controls`."""
    import ipywidgets as w

    pick = w.Dropdown(options=[(f"layer {l}, expert {e}", (l, e)) for l, e in acts], description="expert")
    k = w.FloatSlider(value=0.8, min=0.5, max=0.95, step=0.05, description="sparsity k")
    out = w.Output()
    box = w.VBox([w.HBox([pick, k]), out])
    box.add_class("lab-explorer")

    def update(_=None):
        box.figure = histogram_figure({pick.value: acts[pick.value]}, k.value)
        show_in(out, box.figure)

    pick.observe(update, "value")
    k.observe(update, "value")
    box.controls = [pick, k]
    update()
    return box


def timeline_figure(spans: Sequence[Span], title: str) -> go.Figure:
    """Gantt of one decoded token: compute and transfer lanes, one color per layer, times in ms."""
    fig = go.Figure()
    t0 = min((s.start for s in spans), default=0.0)
    for s in spans:
        fig.add_bar(y=[s.lane], x=[(s.end - s.start) * 1e3], base=[(s.start - t0) * 1e3], orientation="h",
                    marker_color=COLORS[s.layer % len(COLORS)], showlegend=False,
                    hovertemplate=f"layer {s.layer}: {s.what}<br>%{{base:.3f}} – %{{x:.3f}} ms<extra></extra>")
    fig.update_layout(title=title, height=240, barmode="overlay", xaxis_title="ms (Mixtral-equivalent)",
                      margin=dict(l=80))
    return fig


def bytes_figure(bytes_per_token: dict[str, float], title: str) -> go.Figure:
    """Host-to-device bytes per decoded token for each policy (log scale)."""
    fig = go.Figure(go.Bar(x=list(bytes_per_token), y=list(bytes_per_token.values()),
                           text=[f"{v / 1e3:.1f} kB" for v in bytes_per_token.values()], textposition="outside"))
    fig.update_layout(title=title, height=340, yaxis_type="log", yaxis_title="bytes / token")
    return fig


def offload_explorer(simulate: Callable[[float, float, float], dict[str, dict]], budget_kb: float = 140):
    """Live panel over `simulate(pcie_GBps, keep, budget_kB) -> {policy: {"bytes", "tps", "spans", "resident"?}}`
    (a policy that does not fit the device budget is left out): bytes/token, tokens/s and device-resident expert
    bytes per policy, and FloE's timeline of one token. Hooks: `.figure`, `.readout`, `.controls`."""
    import ipywidgets as w

    bw = w.FloatLogSlider(value=25, base=10, min=0, max=2, step=0.1, description="PCIe GB/s")
    keep = w.FloatSlider(value=0.2, min=0.05, max=0.5, step=0.05, description="FloE keep")
    budget = w.FloatLogSlider(value=budget_kb, base=10, min=1, max=3.5, step=0.05, description="expert kB")
    readout, out, out2 = w.HTML(), w.Output(), w.Output()
    readout.add_class("lab-readout")
    box = w.VBox([w.HBox([bw, keep, budget]), readout, out, out2])
    box.add_class("lab-explorer")

    def update(_=None):
        res = simulate(bw.value, keep.value, budget.value)
        readout.value = "; ".join(f"{p}: <b>{r['tps']:.1f}</b> tok/s, {r['bytes'] / 1e3:.1f} kB/token"
                                  + (f", {r['resident'] / 1e3:.0f} kB on device" if "resident" in r else "")
                                  for p, r in res.items())
        shown = "floe" if "floe" in res else next(iter(res))
        if shown != "floe":
            readout.value += f"; FloE does not fit in {budget.value:.0f} kB"
        box.figure = timeline_figure(res[shown]["spans"], f"{shown}, one token at {bw.value:.0f} GB/s")
        show_in(out, box.figure)
        show_in(out2, bytes_figure({p: r["bytes"] for p, r in res.items()}, "bytes per token"))

    for c in (bw, keep, budget):
        c.observe(update, "value")
    box.controls, box.readout = [bw, keep, budget], readout
    update()
    return box
