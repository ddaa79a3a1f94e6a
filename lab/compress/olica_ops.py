"""Olica's per-module operators (He & Lin, ICML 2025; official BetterTMrR/LLM-Olica): the neuron scores of every
recipe and the in-place edits of one attention or MLP module that `lab.compress.olica.prune` applies layer by layer.
Conventions (official code, FLAP) are listed in `lab.compress.olica`'s docstring."""

from __future__ import annotations

import torch
from torch import nn

from lab.compress import pruned_llama as om


def fold_value_bias(attn: nn.Module) -> None:
    """Move v_proj's bias into o_proj's: b_o ← b_o + W_o b_v, b_v ← 0. Exact, because attention weights sum to one,
    so every output carries W_o b_v whatever it attends to (except a query that may attend to nothing, e.g. a
    left-padding position under SDPA, whose output no loss reads); it lets the rotation (which mixes value channels)
    and the pruning (which drops them) act on weights alone. Llama has no biases; a config with `attention_bias`
    does."""
    v, o = attn.v_proj, attn.o_proj
    if v.bias is None:
        return
    b = o.weight.float() @ v.bias.float() + (0 if o.bias is None else o.bias.float())
    attn.o_proj = om.set_linear(o, o.weight, b.to(o.weight.dtype))
    with torch.no_grad():
        v.bias.zero_()


def vo_scores(attn: nn.Module, how: str, s_vin, s_oin, g: torch.Generator, var_oin=None) -> torch.Tensor:
    wv, wo = attn.v_proj.weight.float(), attn.o_proj.weight.float()
    if how == "flap":  # WIFV: input variance of o_proj's channel times its column's squared norm
        return var_oin * wo.pow(2).sum(0)
    if how == "olica":
        return (wv * s_vin.sqrt()).norm(dim=1) + wo.norm(dim=0) * s_oin.sqrt()
    if how == "wanda":
        return (wv.abs() * s_vin.sqrt()).sum(1) + (wo.abs() * s_oin.sqrt()).sum(0)
    if how == "singular":
        return wo.norm(dim=0)
    return torch.rand(wv.shape[0], generator=g).to(wv.device)


def compensated_bias(lin: nn.Linear, keep: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor | None:
    """The bias of `lin` once its input channels outside `keep` are removed: its own bias (if any), plus with `mean`
    (E[x] over calibration tokens) FLAP's compensation W[:, pruned]·E[x_pruned]."""
    if mean is None:
        return lin.bias
    off = torch.ones_like(mean, dtype=torch.bool)
    off[keep] = False
    comp = (lin.weight.float()[:, off] @ mean[off]).to(lin.weight.dtype)
    return comp if lin.bias is None else lin.bias + comp


def prune_vo(attn: nn.Module, scores: torch.Tensor, H: int, d_v: int, mean_oin=None) -> None:
    """Keep the d_v best-scored value neurons of every head (the same count in each); with `mean_oin` (o_proj's mean
    input), FLAP's compensation becomes o_proj's bias."""
    dh = scores.numel() // H
    keep = torch.cat([h * dh + scores.view(H, dh)[h].topk(d_v).indices.sort().values for h in range(H)])
    v, o = attn.v_proj, attn.o_proj
    attn.v_proj = om.set_linear(v, v.weight[keep], None if v.bias is None else v.bias[keep])
    attn.o_proj = om.set_linear(o, o.weight[:, keep], compensated_bias(o, keep, mean_oin))
    attn.v_head_dim = d_v


def ffn_scores(mlp: nn.Module, how: str, s_in, s_mid, g: torch.Generator, var_mid=None) -> torch.Tensor:
    up, gate, down = mlp.up_proj.weight.float(), mlp.gate_proj.weight.float(), mlp.down_proj.weight.float()
    if how == "flap":
        return var_mid * down.pow(2).sum(0)
    if how == "olica":
        return (up * s_in.sqrt()).norm(dim=1) + (gate * s_in.sqrt()).norm(dim=1) + down.norm(dim=0) * s_mid.sqrt()
    if how == "wanda":
        return ((up.abs() + gate.abs()) * s_in.sqrt()).sum(1) + (down.abs() * s_mid.sqrt()).sum(0)
    return torch.rand(up.shape[0], generator=g).to(up.device)


def ffn_keep(scores: torch.Tensor, n_keep: int, protect: float = 0.01) -> torch.Tensor:
    """Indices kept: ascending order, the lowest `protect` fraction kept (official quirk), the next ones pruned."""
    order, F = scores.argsort(), scores.numel()
    p = int(protect * F) if n_keep >= int(protect * F) else 0
    pruned = order[p:p + F - n_keep]
    mask = torch.ones(F, dtype=torch.bool, device=scores.device)
    mask[pruned] = False
    return mask.nonzero().squeeze(1)


def prune_ffn(mlp: nn.Module, keep: torch.Tensor, mean_mid: torch.Tensor | None = None) -> None:
    """Keep the FFN channels `keep` (gate/up rows with their biases, down columns); with `mean_mid` (down_proj's mean
    input), FLAP's compensation becomes down_proj's bias."""
    bias = compensated_bias(mlp.down_proj, keep, mean_mid)
    mlp.gate_proj, mlp.up_proj = (om.set_linear(m, m.weight[keep], None if m.bias is None else m.bias[keep])
                                  for m in (mlp.gate_proj, mlp.up_proj))
    mlp.down_proj, mlp.intermediate_size = om.set_linear(mlp.down_proj, mlp.down_proj.weight[:, keep], bias), len(keep)


def low_rank_linear(lin: nn.Linear, w1: torch.Tensor, w2: torch.Tensor) -> nn.Sequential:
    """`lin` replaced by x ↦ W2 (W1 x) (+ its bias: a biased Q/K under `attention_bias` keeps it after the product);
    W1 (r, in), W2 (out, r)."""
    w = lin.weight
    lr = om.low_rank(w.shape[1], w1.shape[0], w.shape[0], lin.bias is not None).to(w.device, w.dtype)
    lr[0].weight.copy_(w1), lr[1].weight.copy_(w2)
    if lin.bias is not None:
        lr[1].bias.copy_(lin.bias)
    return lr
