"""The critical-token explorer: a trajectory as a strip of tokens colored by criticality 1 − s_t (the
contrastive-estimation score of `lab.align.cdpo.ce_scores`), the rollout correctness c_t under it
where it was computed, the rollout-found critical token boxed; a β slider re-scores, a position
slider reports Pass@k with that token kept and with it replaced.

Works on any (positive, negative) pair of causal LMs sharing a tokenizer — toys or `load_model`
checkpoints — because it only needs token ids. `critical_figure` is the precomputed plotly view.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from lab.align.cdpo import Grade, ce_scores
from lab.align.critical_tokens import replacement
from lab.models.sample import pass_at_k
from lab.widgets.figures import lines, show_in

PassK = Callable[[int, int], tuple[dict[int, float], dict[int, float]]]  # (trajectory, position) -> kept, replaced


def replacement_pass_k(model, prompts: torch.Tensor, responses: torch.Tensor, grade: Grade, *, K: int,
                       ks: Sequence[int], generator: torch.Generator, device: str = "cpu") -> PassK:
    """The explorer's `pass_k(i, t)`: the replacement test (`cdpo.replacement`, K rollouts) at position t of
    trajectory i, as Pass@k for each k in ks with y_t kept and with y_t replaced. `grade(rows, responses)`
    grades rows of the full set."""

    def pass_k(i: int, t: int) -> tuple[dict[int, float], dict[int, float]]:
        kept, swapped = replacement(model, prompts[i:i + 1].to(device), responses[i:i + 1].to(device),
                                    torch.tensor([t]), lambda r, y: grade(torch.tensor([i]), y), K=K,
                                    generator=generator)
        return ({k: pass_at_k(K, int(kept.sum()), k) for k in ks}, {k: pass_at_k(K, int(swapped.sum()), k) for k in ks})

    return pass_k


def trajectory_items(tokenizer, prompts: torch.Tensor, responses: torch.Tensor, s: torch.Tensor, c: torch.Tensor,
                     critical: torch.Tensor, n: int) -> list[dict]:
    """The first n trajectories as `critical_figure` items: label "prompt → response", tokens, s_t, c_t and the
    critical token."""
    return [{"label": f"{tokenizer.decode(prompts[i])} → {tokenizer.decode(responses[i])}",
             "tokens": tokenizer.convert_ids_to_tokens(responses[i].tolist()), "s": s[i], "c": c[i],
             "critical": int(critical[i])} for i in range(n)]


def dynamics_figure(results: dict[tuple[str, float], dict], best: dict[str, float], *, title: str) -> go.Figure:
    """Fig. 4: each arm's mean chosen (solid) and rejected (dashed) log-likelihood during training at its best
    lr, from `cdpo.lr_sweep`'s results."""
    curves = {}
    for arm, lr in best.items():
        log = results[arm, lr]["log"]
        curves[f"{arm} chosen"], curves[f"{arm} rejected"] = log["chosen"], log["rejected"]
    return lines(log["step"], curves, title=title, xlabel="step", ylabel="mean log-likelihood",
                 dash=lambda name: name.endswith("rejected"))


def strip_traces(tokens: Sequence[str], s: torch.Tensor, c: torch.Tensor | None, *, visible: bool = True) -> list:
    """The heat strip of 1 − s_t (row 1) and the rollout curve c_t (row 2; c may be one shorter than the tokens:
    no rollout from the full trajectory) as plotly traces."""
    x = [f"{t}:{tok}" for t, tok in enumerate(tokens)]
    traces = [go.Heatmap(z=[(1 - s).tolist()], x=x, y=["1 − s_t"], zmin=0, zmax=1, colorscale="Reds",
                         text=[[f"{tok}<br>s={v:.3f}" for tok, v in zip(tokens, s.tolist())]],
                         texttemplate="%{text}", showscale=False, visible=visible,
                         hovertemplate="%{x}: criticality %{z:.3f}<extra></extra>")]
    if c is not None:
        traces.append(go.Scatter(x=x, y=c.tolist(), mode="lines+markers", name="rollout c_t", visible=visible,
                                 hovertemplate="%{x}: %{y:.2f} of rollouts correct<extra></extra>"))
    return traces


def _boxes(critical: int | None) -> list[dict]:
    """A frame around the critical token on the strip (row 1 axes), or nothing."""
    if critical is None or critical < 0:
        return []
    return [dict(type="rect", xref="x", yref="y", x0=critical - 0.5, x1=critical + 0.5, y0=-0.5, y1=0.5,
                 line=dict(color="black", width=3))]


def _layout(fig: go.Figure, title: str, critical: int | None) -> None:
    fig.update_layout(title=title, height=360, margin=dict(t=60, b=40), showlegend=False, shapes=_boxes(critical))
    fig.update_yaxes(range=[-0.05, 1.05], title="c_t", row=2, col=1)


def critical_figure(items: Sequence[dict], *, title: str = "criticality of rejected trajectories") -> go.Figure:
    """Precomputed view: items {label, tokens, s, c (or None), critical (or None)}, a dropdown to switch."""
    fig = make_subplots(rows=2, cols=1, row_heights=[0.45, 0.55], shared_xaxes=False, vertical_spacing=0.12)
    owner = []
    for k, it in enumerate(items):
        for row, tr in enumerate(strip_traces(it["tokens"], it["s"], it.get("c"), visible=k == 0), start=1):
            fig.add_trace(tr, row=row, col=1)
            owner.append(k)
    _layout(fig, title, items[0].get("critical") if items else None)
    buttons = [dict(label=it["label"], method="update",
                    args=[{"visible": [o == k for o in owner]}, {"shapes": _boxes(it.get("critical"))}])
               for k, it in enumerate(items)]
    if len(items) > 1:
        fig.update_layout(updatemenus=[dict(buttons=buttons, x=1.0, xanchor="right", y=1.2)])
    return fig


def critical_explorer(pos, neg, tokenizer, prompts: torch.Tensor, responses: torch.Tensor, *,
                      rollouts: torch.Tensor | None = None, critical: torch.Tensor | None = None,
                      pass_k: PassK | None = None, labels: Sequence[str] | None = None, beta: float = 1.0):
    """Live panel over rejected trajectories `responses` (n, L) of `prompts` (n, P).

    `rollouts` (n, L − 1) and `critical` (n,) come from `lab.align.critical_tokens.rollout_correctness` /
    `critical_token` (c_t for the proper prefixes y_≤t only: the full trajectory is not rolled out, so the last
    token has no point);
    `pass_k(i, t)` returns ({k: Pass@k} with y_t kept, {k: Pass@k} with y_t replaced), cached here.
    Test hooks: `.figure`, `.readout`, `.controls`, `.scores` (the last s, (L,))."""
    import ipywidgets as w

    n, L = responses.shape
    labels = list(labels) if labels is not None else [f"trajectory {i}" for i in range(n)]
    which = w.Dropdown(options=[(lab, i) for i, lab in enumerate(labels)], description="trajectory")
    b = w.FloatSlider(value=beta, min=-1.0, max=4.0, step=0.25, description="β")
    t = w.IntSlider(value=0, min=0, max=L - 1, description="position")
    readout, out = w.HTML(), w.Output()
    readout.add_class("lab-readout")
    box = w.VBox([w.HBox([which, b, t]), readout, out])
    box.add_class("lab-explorer")
    cache: dict[tuple[int, int], tuple[dict, dict]] = {}

    def update(_=None):
        i = which.value
        s = ce_scores(pos, neg, prompts[i:i + 1], responses[i:i + 1], beta=b.value)[0]  # (L,)
        tokens = tokenizer.convert_ids_to_tokens(responses[i].tolist())
        fig = make_subplots(rows=2, cols=1, row_heights=[0.45, 0.55], vertical_spacing=0.12)
        for row, tr in enumerate(strip_traces(tokens, s, None if rollouts is None else rollouts[i]), start=1):
            fig.add_trace(tr, row=row, col=1)
        crit = None if critical is None else int(critical[i])
        _layout(fig, f"{labels[i]}: criticality 1 − s_t at β = {b.value:g} (box: rollout critical token)", crit)
        box.figure, box.scores = fig, s
        text = (f"position {t.value} <b>{html.escape(tokens[t.value])}</b>: s_t = {s[t.value]:.3f}; "
                f"lowest s at position {int(s.argmin())}" + (f"; rollout critical token: {crit}" if crit is not None
                                                              else ""))
        if pass_k is not None:
            if (i, t.value) not in cache:
                cache[i, t.value] = pass_k(i, t.value)
            kept, swapped = cache[i, t.value]
            text += "<br>Pass@k with this token kept / replaced: " + ", ".join(
                f"@{k} {kept[k]:.2f} / <b>{swapped[k]:.2f}</b>" for k in kept)
        readout.value = text
        show_in(out, fig)

    for control in (which, b, t):
        control.observe(update, "value")
    box.controls, box.readout, box.pass_cache = {"trajectory": which, "beta": b, "position": t}, readout, cache
    update()
    return box
