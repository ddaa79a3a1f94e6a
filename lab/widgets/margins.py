"""The reward-margin explorer: how far each policy's implicit reward puts the chosen response above
each rejected one, r = β(log π_θ − log π_ref), per prompt and over all prompts, for several trained
policies side by side, with a selector over precomputed settings (β, λ, γ, ...).

Works on any policy/reference pair: the inputs are (B, n) sequence log-probs, column 0 chosen,
columns 1.. rejected (the `lab.align` loss signature).
"""

from __future__ import annotations

import html

import plotly.graph_objects as go
import torch

from lab.widgets.figures import show_in


def reward_margins(pi: torch.Tensor, ref: torch.Tensor, beta: float = 1.0) -> dict[str, torch.Tensor]:
    """`each` (B, n−1): r(y_w) − r(y_l,k); `hardest` (B,): the smallest of them (the closest rejected)."""
    r = beta * (pi - ref)  # (B, n)
    each = r[:, :1] - r[:, 1:]
    return {"each": each, "hardest": each.min(-1).values}


def summary(m: dict[str, torch.Tensor]) -> dict[str, float]:
    h = m["hardest"]
    return {"mean hardest margin": float(h.mean()),
            "share of prompts with a rejected ranked above": float((h < 0).double().mean()),
            "mean margin": float(m["each"].mean())}


def margin_figure(runs: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]], *, beta: float = 1.0,
                  title: str = "hardest-rejected reward margin per prompt") -> go.Figure:
    """Precomputed view: overlaid histograms of the hardest margin per policy; a dropdown per setting."""
    fig, owner = go.Figure(), []
    for s, policies in enumerate(runs.values()):
        for name, (pi, ref) in policies.items():
            fig.add_histogram(x=reward_margins(pi, ref, beta)["hardest"].tolist(), name=name, opacity=0.6,
                              visible=s == 0)
            owner.append(s)
    buttons = [dict(label=label, method="update", args=[{"visible": [o == s for o in owner]}])
               for s, label in enumerate(runs)]
    menus = [dict(buttons=buttons, x=1.0, xanchor="right", y=1.15)] if len(runs) > 1 else []
    fig.update_layout(title=title, barmode="overlay", xaxis_title="r(chosen) − max r(rejected)", yaxis_title="prompts",
                      height=380, updatemenus=menus)
    fig.add_vline(x=0, line=dict(color="#888", dash="dot"))
    return fig


def margin_explorer(runs: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]], *, beta: float = 1.0):
    """Live panel: a setting selector, a prompt slider; the readout compares the policies' margins
    (aggregate and on the chosen prompt) and the figure shows the per-rejected margins of that
    prompt. Test hooks: `.controls`, `.readout`, `.figure`."""
    import ipywidgets as w

    setting = w.Dropdown(options=list(runs), description="setting")
    first = next(iter(next(iter(runs.values())).values()))[0]
    prompt = w.IntSlider(value=0, min=0, max=first.shape[0] - 1, description="prompt")
    readout, out = w.HTML(), w.Output()
    readout.add_class("lab-readout")
    box = w.VBox([w.HBox([setting, prompt]), readout, out])
    box.add_class("lab-explorer")

    def update(_=None):
        rows, fig = [], go.Figure()
        for name, (pi, ref) in runs[setting.value].items():
            m = reward_margins(pi, ref, beta)
            s = summary(m)
            b = prompt.value
            rows.append(f"<tr><td>{html.escape(name)}</td><td>{s['mean hardest margin']:.3f}</td>"
                        f"<td>{s['share of prompts with a rejected ranked above']:.3f}</td>"
                        f"<td>{float(m['hardest'][b]):.3f}</td></tr>")
            fig.add_bar(x=[f"rejected {k + 1}" for k in range(m["each"].shape[1])], y=m["each"][b].tolist(), name=name)
        readout.value = ("<table><tr><th>policy</th><th>mean hardest margin</th><th>share mis-ranked</th>"
                         f"<th>prompt {prompt.value}: hardest margin</th></tr>" + "".join(rows) + "</table>")
        fig.update_layout(title=f"prompt {prompt.value}: r(chosen) − r(rejected k)", barmode="group", height=320)
        box.figure = fig
        show_in(out, fig)

    setting.observe(update, "value")
    prompt.observe(update, "value")
    box.controls = {"setting": setting, "prompt": prompt}
    box.readout = readout
    update()
    return box
