"""The attention-head explorer: look at one head's (hidden-)attention map on a prompt, switch the
head off and watch the task accuracy, and see the accuracy drop of every head at once.

Works on any causal LM the lab can build or load (`lab.models` toys, `load_model` checkpoints with
eager attention, Mamba-1/2 via hidden attention), because it only uses `lab.interp.hidden_attention.attention`
for the maps and `lab.models.hooks` (`ablate_heads` for the switch, `layers` / `head_shape` for the sizes).
`head_explorer` is the live panel; `attention_figure` and `drop_figure` are the precomputed plotly views for
the report.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import plotly.graph_objects as go
import torch

from lab.interp.hidden_attention import attention
from lab.models import hooks
from lab.widgets.figures import show_in

Evaluate = Callable[[torch.nn.Module, object], float]  # (model, tokenizer) -> accuracy


def minmax(a: torch.Tensor) -> torch.Tensor:
    """Min-max normalise a whole matrix to [0, 1] (the official plots' default; SSM maps can be < 0)."""
    lo, hi = a.min(), a.max()
    return (a - lo) / (hi - lo).clamp_min(1e-12)


def tokens_of(tokenizer, prompt: str) -> tuple[torch.Tensor, list[str]]:
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]  # (1, T)
    return ids, tokenizer.convert_ids_to_tokens(ids[0].tolist())


def head_map(model, tokenizer, prompt: str, layer: int, head: int) -> tuple[torch.Tensor, list[str]]:
    """One head's map on a prompt, min-max normalised: (T, T), and the token labels."""
    ids, toks = tokens_of(tokenizer, prompt)
    ids = ids.to(next(model.parameters()).device)
    return minmax(attention(model, ids, layer)[0, head].cpu()), toks


def head_maps(model, tokenizer, prompt: str, heads: Sequence[tuple[int, int]]
              ) -> tuple[dict[tuple[int, int], torch.Tensor], list[str]]:
    """`head_map` of several (layer, head)s on one prompt: {(layer, head): (T, T)} and the token labels."""
    maps = {}
    for layer, head in heads:
        maps[layer, head], toks = head_map(model, tokenizer, prompt, layer, head)
    return maps, toks


def _labels(tokens: Sequence[str]) -> list[str]:
    return [f"{i}:{t}" for i, t in enumerate(tokens)]  # unique labels, repeated tokens stay distinct


def attention_figure(maps: dict[tuple[int, int], torch.Tensor], tokens: Sequence[str], *, title: str = "") -> go.Figure:
    """Precomputed view: heat maps of several (layer, head) maps with a dropdown to switch."""
    labels = _labels(tokens)
    fig = go.Figure()
    keys = list(maps)
    for k, (layer, head) in enumerate(keys):
        fig.add_heatmap(z=maps[layer, head].tolist(), x=labels, y=labels, colorscale="Blues", zmin=0, zmax=1,
                        visible=k == 0, name=f"L{layer}H{head}", showscale=k == 0,
                        hovertemplate="query %{y} → key %{x}: %{z:.2f}<extra></extra>")
    buttons = [dict(label=f"layer {l} head {h}", method="update",
                    args=[{"visible": [j == k for j in range(len(keys))]}]) for k, (l, h) in enumerate(keys)]
    fig.update_layout(title=title, height=520, margin=dict(t=80, l=80),
                      updatemenus=[dict(buttons=buttons, x=1.0, xanchor="right", y=1.12)] if len(keys) > 1 else [])
    fig.update_yaxes(autorange="reversed", title="query position")
    fig.update_xaxes(title="key position", tickangle=-60)
    return fig


def drop_figure(drop: torch.Tensor, *, layers: Sequence[int] | None = None,
                title: str = "accuracy drop when one head is removed") -> go.Figure:
    """Layer × head heat map of accuracy drops (as `lab.interp.ablation.head_sweep` measures);
    `layers` names the rows (default 0..L-1)."""
    L, H = drop.shape
    layers = list(range(L)) if layers is None else list(layers)
    fig = go.Figure(go.Heatmap(z=drop.tolist(), x=[f"H{h}" for h in range(H)], y=[f"L{l}" for l in layers],
                               colorscale="Reds", zmin=0, zmax=max(0.05, float(drop.max())),
                               texttemplate="%{z:.2f}" if H <= 16 else None,
                               hovertemplate="layer %{y}, head %{x}: drop %{z:.3f}<extra></extra>"))
    fig.update_layout(title=title, height=140 + 40 * L, margin=dict(t=50))
    fig.update_yaxes(autorange="reversed")
    return fig


def head_explorer(models: dict[str, tuple[torch.nn.Module, object]], prompts: Sequence[str], evaluate: Evaluate,
                  *, drops: dict[str, torch.Tensor | tuple[torch.Tensor, Sequence[int]]] | None = None):
    """Live panel over `models` ({name: (model, tokenizer)}) and `prompts`.

    Controls: model, layer, head, prompt, and an "ablate" toggle that removes the selected head
    (zeroing its output-projection columns, restored when toggled off) and reports `evaluate`'s
    accuracy with and without it. `drops` ({name: (L, H) accuracy drops, or (drops, layer indices)})
    adds the layer × head map.
    Test hooks: `.figure` (the current attention figure), `.readout` (HTML), `.drop_fig`, `.accuracy`
    (the last `(name, layer, head, ablated)` -> accuracy results) and the controls by name.
    """
    import ipywidgets as w

    name = w.Dropdown(options=list(models), description="model")
    layer = w.IntSlider(min=0, description="layer")
    head = w.IntSlider(min=0, description="head")
    prompt = w.Dropdown(options=[(p if len(p) < 60 else p[:57] + "...", i) for i, p in enumerate(prompts)],
                        description="prompt")
    ablate = w.ToggleButton(value=False, description="ablate head", icon="scissors")
    readout, out_map, out_drop = w.HTML(), w.Output(), w.Output()
    readout.add_class("lab-readout")
    box = w.VBox([w.HBox([name, prompt]), w.HBox([layer, head, ablate]), readout, out_map, out_drop])
    box.add_class("lab-explorer")
    box.accuracy, box.figure, box.drop_fig = {}, None, None

    def acc(key) -> float:
        if key not in box.accuracy:
            model, tok = models[key[0]]
            if key[3]:
                with hooks.ablate_heads(model, {key[1]: [key[2]]}):
                    box.accuracy[key] = evaluate(model, tok)
            else:
                box.accuracy[key] = evaluate(model, tok)
        return box.accuracy[key]

    def sizes(_=None):
        model, _tok = models[name.value]
        layer.max = len(hooks.layers(model)) - 1
        head.max = hooks.head_shape(model, layer.value)[0] - 1
        if drops and name.value in drops:
            d = drops[name.value]
            drop, rows = d if isinstance(d, tuple) else (d, None)
            box.drop_fig = drop_figure(drop, layers=rows, title=f"{name.value}: accuracy drop per removed head")
            show_in(out_drop, box.drop_fig)
        else:  # no sweep for this model: no stale map of another one
            box.drop_fig, out_drop.outputs = None, ()

    def update(_=None):
        model, tok = models[name.value]
        l, h = layer.value, min(head.value, hooks.head_shape(model, layer.value)[0] - 1)
        with hooks.ablate_heads(model, {l: [h]}) if ablate.value else nullcontext():
            m, toks = head_map(model, tok, prompts[prompt.value], l, h)
        box.figure = attention_figure({(l, h): m}, toks, title=f"{name.value}: layer {l}, head {h}"
                                      + (" (ablated)" if ablate.value else ""))
        base = acc((name.value, l, h, False))
        text = f"{html.escape(name.value)} L{l}H{h}: accuracy {base:.3f}"
        if ablate.value:
            cut = acc((name.value, l, h, True))
            text += f" → <b>{cut:.3f}</b> with this head removed (drop {base - cut:+.3f})"
        readout.value = text
        show_in(out_map, box.figure)

    name.observe(lambda c: (sizes(), update()), "value")
    layer.observe(lambda c: (sizes(), update()), "value")
    for control in (head, prompt, ablate):
        control.observe(update, "value")
    box.controls = {"model": name, "layer": layer, "head": head, "prompt": prompt, "ablate": ablate}
    box.readout = readout
    sizes()
    update()
    return box

