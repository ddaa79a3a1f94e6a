"""The calibrated-reward explorer (InfAlign's analytical tool): pick the inference-time procedure
(BoN / WoN), N, the exponential transform's t and the KL weight β, and see the induced density q(u)
over the calibrated reward u, its KL to the base policy and its win rates.

`calibrated_explorer` is the live panel; `frontier_figure` draws precomputed win-rate-vs-KL curves
for the report (one trace per transform, a dropdown per setting).
"""

from __future__ import annotations

import html
import math

import plotly.graph_objects as go

from lab.align import infalign as I
from lab.widgets.figures import show_in


def frontier_figure(curves: dict[str, dict[str, tuple[list[float], list[float]]]], *,
                    title: str = "win rate vs KL to π_ref") -> go.Figure:
    """`curves` = {setting: {transform: (KLs, win rates)}}; a dropdown switches the setting."""
    fig = go.Figure()
    owner = []
    for s, by_t in enumerate(curves.values()):
        for name, (kls, wins) in by_t.items():
            fig.add_scatter(x=kls, y=wins, mode="lines", name=name, visible=s == 0)
            owner.append(s)
    buttons = [dict(label=setting, method="update", args=[{"visible": [o == s for o in owner]}])
               for s, setting in enumerate(curves)]
    fig.update_layout(title=title, xaxis=dict(title="KL(π ‖ π_ref)", type="log"), yaxis_title="win rate", height=420,
                      updatemenus=[dict(buttons=buttons, x=1.0, xanchor="right", y=1.15)])
    return fig


def calibrated_explorer(*, M: int = 2000):
    """Live panel. Test hooks: `.controls`, `.readout` (HTML), `.figure` (the density plot)."""
    import ipywidgets as w

    kind = w.ToggleButtons(options=[("Best-of-N", "bon"), ("Worst-of-N", "won")], description="T")
    N = w.IntSlider(value=4, min=1, max=32, description="N")
    t = w.FloatSlider(value=10.0, min=0.0, max=40.0, step=0.5, description="t")
    log_beta = w.FloatSlider(value=0.0, min=-3.0, max=3.0, step=0.1, description="log₁₀ β")
    readout, out = w.HTML(), w.Output()
    readout.add_class("lab-readout")
    box = w.VBox([w.HBox([kind, N]), w.HBox([t, log_beta]), readout, out])
    box.add_class("lab-explorer")
    u = I.grid(M)

    def update(_=None):
        phi = (I.exp_bon if kind.value == "bon" else I.exp_won)(t.value) if t.value > 0 else I.identity
        # β is relative to the transform's range, so one slider serves every t
        span = float((phi(u).max() - phi(u).min()).clamp_min(1e-12))
        q = I.density(phi, span * 10 ** log_beta.value, u)
        box.state = {"kl": I.kl_to_base(q), "w1": I.win_rate(q), "wN": I.win_rate(q, N.value, kind.value)}
        label = "exp(t·u)" if kind.value == "bon" else "−exp(−t·u)"
        readout.value = html.escape(f"Φ = {label if t.value > 0 else 'identity'}, t = {t.value:g}: "
                                    f"KL = {box.state['kl']:.3f}, standard win = {box.state['w1']:.3f}, "
                                    f"{'BoN' if kind.value == 'bon' else 'WoN'}-{N.value} win = {box.state['wN']:.3f}")
        box.figure = go.Figure(go.Scatter(x=u[::10].tolist(), y=q[::10].tolist(), mode="lines", name="q(u)"))
        box.figure.update_layout(title="density of the calibrated reward under π", xaxis_title="u = C(x, y)",
                                 yaxis_title="q(u)", height=300, margin=dict(t=40))
        show_in(out, box.figure)

    for c in (kind, N, t, log_beta):
        c.observe(update, "value")
    box.controls = {"kind": kind, "N": N, "t": t, "log_beta": log_beta}
    box.readout = readout
    update()
    assert math.isfinite(box.state["kl"])
    return box
