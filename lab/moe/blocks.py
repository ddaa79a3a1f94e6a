"""Sparse-MoE blocks of a `transformers` Mixtral-style model: the experts' weights, the router, the block's
inputs, and the block run with its experts computed by a function.

A Mixtral expert is a_E(x) = (SiLU(x W_gate) ⊙ (x W_up)) W_down; the block sends each token to its top-k
experts by the router and sums their outputs weighted by the renormalised top-k router probabilities.
On transformers 5.x the experts are fused: `layers[i].mlp.experts.gate_up_proj` (E, 2F, H) — gate is the
first F rows, up the second — and `down_proj` (E, H, F); the router is `layers[i].mlp.gate`.

Shared by the MoE papers (FloE's sparsified and quantized experts, HC-SMoE's merged experts) and the
offload engine: an `ExpertFn(layer, e, x)` replaces expert e of a layer, `use_experts` runs the model
with it, `layer_errors` measures what it changes in every block's output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F_
from torch import Tensor, nn

from lab.models import hooks

ExpertFn = Callable[[int, int, Tensor], Tensor]  # (layer, expert, x (n, H)) -> expert output (n, H)


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse-MoE block of every decoder layer (has `.gate` router and fused `.experts`)."""
    return [layer.mlp for layer in hooks.layers(model)]


def weights(mlp: nn.Module, e: int) -> tuple[Tensor, Tensor, Tensor]:
    """Expert e's W_gate (F, H), W_up (F, H), W_down (H, F) — views of the fused parameters."""
    F = mlp.experts.down_proj.shape[-1]
    gu = mlp.experts.gate_up_proj[e]
    return gu[:F], gu[F:], mlp.experts.down_proj[e]


def expert(x: Tensor, Wg: Tensor, Wu: Tensor, Wd: Tensor) -> Tensor:
    """The dense expert (SiLU(x W_gateᵀ) ⊙ x W_upᵀ) W_downᵀ: x (n, H), W_gate/W_up (F, H), W_down (H, F) -> (n, H),
    computed in x's dtype (float32 inputs of a bfloat16 model: its weights upcast, the analysis in float32)."""
    Wg, Wu, Wd = (w.to(x.dtype) for w in (Wg, Wu, Wd))
    return (F_.silu(x @ Wg.T) * (x @ Wu.T)) @ Wd.T


def dense_fn(model: nn.Module) -> ExpertFn:
    """The model's own experts as an `ExpertFn` (the reference every replacement is compared with)."""
    blocks = moe_blocks(model)
    return lambda l, e, x: expert(x, *weights(blocks[l], e))


@torch.no_grad()
def moe_inputs(model: nn.Module, input_ids: Tensor) -> list[Tensor]:
    """Teacher-forced MoE inputs of every layer, [(N, H)] with N = batch·T (post-attention-norm states)."""
    with hooks.capture(moe_blocks(model)) as store:
        model(input_ids=input_ids)
    return [x.reshape(-1, x.shape[-1]) for calls in store for x in calls]


def route(mlp: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Router logits (n, E), renormalised top-k weights (n, k) and expert indices (n, k), routed in the router's
    dtype as the model routes (float32 analysis inputs of a bfloat16 model are its bfloat16 states, upcast)."""
    return mlp.gate(x.to(mlp.gate.weight.dtype))


def moe_out(mlp: nn.Module, x: Tensor, fn: Callable[[int, Tensor], Tensor], idx: Tensor | None = None,
            w: Tensor | None = None) -> Tensor:
    """Σ_e w_e · fn(e, x) over each token's routed experts (the MoE block's output, (n, H))."""
    if idx is None:
        _, w, idx = route(mlp, x)
    y = torch.zeros_like(x)
    for e in idx.unique().tolist():
        tok, slot = torch.where(idx == e)
        y.index_add_(0, tok, fn(e, x[tok]) * w[tok, slot, None])
    return y


@torch.no_grad()
def layer_errors(model: nn.Module, xs: list[Tensor], fn: ExpertFn) -> Tensor:
    """Relative MoE-output error ||y_fn − y||² / ||y||² per layer (L,), same routing, teacher-forced inputs."""
    out = []
    for l, (mlp, x) in enumerate(zip(moe_blocks(model), xs)):
        _, w, idx = route(mlp, x)
        y = moe_out(mlp, x, lambda e, xe, mlp=mlp: expert(xe, *weights(mlp, e)), idx, w)
        y_v = moe_out(mlp, x, lambda e, xe, l=l: fn(l, e, xe), idx, w)
        out.append(((y_v - y).pow(2).sum() / y.pow(2).sum()).item())
    return torch.tensor(out)


class _Experts(nn.Module):
    """Drop-in for `mlp.experts` (same forward signature) that computes each expert with `fn(e, x)` on float32 inputs
    (the analysis precision; a no-op for a float32 model), its output cast back to the model's dtype."""

    def __init__(self, fn: Callable[[int, Tensor], Tensor], orig: nn.Module):
        super().__init__()
        self.fn, self.orig = fn, orig
        self.gate_up_proj, self.down_proj = orig.gate_up_proj, orig.down_proj  # still readable by `weights`

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        y = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            tok, slot = torch.where(top_k_index == e)
            out = self.fn(e, hidden_states[tok].float()) * top_k_weights[tok, slot, None].float()
            y.index_add_(0, tok, out.to(y.dtype))
        return y


@contextlib.contextmanager
def use_experts(model: nn.Module, fn: ExpertFn, layers: list[int] | None = None) -> Iterator[nn.Module]:
    """Run `model` with the experts of `layers` (default all) computed by `fn(layer, e, x)`."""
    blocks = moe_blocks(model)
    layers = range(len(blocks)) if layers is None else layers
    new = {hooks.name_of(model, blocks[l].experts): _Experts(lambda e, x, l=l: fn(l, e, x), blocks[l].experts)
           for l in layers}
    with hooks.swap(model, new):
        yield model


@torch.no_grad()
def eval_loss(model: nn.Module, batch: dict[str, Tensor], fn: ExpertFn | None = None,
              layers: list[int] | None = None) -> float:
    """Mean next-token loss on `batch`, with the experts of `layers` replaced by `fn` when given."""
    if fn is None:
        return model(**batch).loss.item()
    with use_experts(model, fn, layers):
        return model(**batch).loss.item()
