"""The next-token explorer: what a causal LM predicts among a set of choices, per prompt, as the
sampling temperature T changes: p_T(c | prompt) = softmax_c(log p(c | prompt) / T).

`next_token_explorer` is the live ipywidgets panel (callbacks need a kernel); `next_token_figure` is
the same content precomputed as a plotly figure with a temperature slider, which stays interactive in
the offline HTML report. Both take data, so they work for any model: `choice_logprobs` gives it.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import plotly.graph_objects as go
import torch


def tempered(logp: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logp / T) over the last dimension (the choices)."""
    return (logp / temperature).softmax(-1)


def bars_html(labels: Sequence[str], probs: Sequence[float], *, highlight: str | None = None, top: int = 8) -> str:
    """A small horizontal bar chart in plain HTML (renders without JavaScript, live or offline)."""
    rows = sorted(zip(probs, labels), reverse=True)[:top]
    out = []
    for p, lab in rows:
        color = "#1a7f37" if lab == highlight else "#4c78a8"
        out.append(f"<div style='display:flex;align-items:center;gap:6px;font:12px monospace'>"
                   f"<span style='width:4em;text-align:right'>{html.escape(lab)}</span>"
                   f"<span style='display:inline-block;height:12px;width:{300 * p:.0f}px;background:{color}'></span>"
                   f"<span>{p:.3f}</span></div>")
    return "".join(out)


def describe(logp: torch.Tensor, choices: Sequence[str], answer: str, temperature: float) -> str:
    """One line of text: the prediction at temperature T, its probability, and the answer's."""
    p = tempered(logp, temperature)
    best = int(p.argmax())
    mark = "correct" if choices[best] == answer else "wrong"
    return (f"T = {temperature:.2f}: predicts {choices[best]} (p = {p[best]:.3f}, {mark}); "
            f"answer {answer} has p = {p[list(choices).index(answer)]:.3f}")


def next_token_explorer(prompts: Sequence[str], answers: Sequence[str], logp: torch.Tensor,
                        choices: Sequence[str], *, temperature: float = 1.0):
    """Live panel: an example slider, a temperature slider, a text readout and a bar chart.

    `logp` is (N, C): log p(choice | prompt) for each prompt. Returns the `VBox` (CSS class
    `lab-explorer`); its children are reachable as attributes `.example`, `.temperature`,
    `.readout` (class `lab-readout`) and `.bars` for tests and for wiring more widgets.
    """
    import ipywidgets as w

    example = w.IntSlider(value=0, min=0, max=len(prompts) - 1, description="example")
    temp = w.FloatSlider(value=temperature, min=0.1, max=3.0, step=0.1, description="T", readout_format=".1f")
    prompt = w.HTML()
    readout = w.HTML()
    readout.add_class("lab-readout")
    bars = w.HTML()

    def update(_=None):
        i, t = example.value, temp.value
        prompt.value = f"<code>{html.escape(prompts[i])} → ?</code>"
        readout.value = html.escape(describe(logp[i], choices, answers[i], t))
        bars.value = bars_html(choices, tempered(logp[i], t).tolist(), highlight=answers[i])

    example.observe(update, "value")
    temp.observe(update, "value")
    update()
    box = w.VBox([w.HBox([example, temp]), prompt, readout, bars])
    box.add_class("lab-explorer")
    box.example, box.temperature, box.readout, box.bars = example, temp, readout, bars
    return box


def next_token_figure(logp: torch.Tensor, choices: Sequence[str], answer: str, *,
                      temperatures: Sequence[float] = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0), title: str = "") -> go.Figure:
    """Precomputed view for one prompt: bars of p_T(choice) with a plotly slider over T."""
    fig = go.Figure()
    colors = ["#1a7f37" if c == answer else "#4c78a8" for c in choices]
    for k, t in enumerate(temperatures):
        fig.add_bar(x=list(choices), y=tempered(logp, t).tolist(), marker_color=colors, visible=k == 0,
                    name=f"T={t:g}")
    steps = [dict(method="update", label=f"{t:g}", args=[{"visible": [j == k for j in range(len(temperatures))]}])
             for k, t in enumerate(temperatures)]
    fig.update_layout(title=title, yaxis=dict(title="p_T(choice)", range=[0, 1]), height=360,
                      sliders=[dict(active=0, currentvalue=dict(prefix="T = "), steps=steps, pad=dict(t=40))],
                      margin=dict(t=50, b=40))
    return fig
