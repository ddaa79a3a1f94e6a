r"""Hidden attention: the $T \times T$ matrix that an SSM layer applies to its inputs, so SSM heads
can be inspected like attention heads.

A selective SSM is linear in its (post-conv) input $x$ once $\Delta, B, C$ are fixed, so unrolling the
recurrence $h_i = e^{\Delta_i A} h_{i-1} + \Delta_i B_i x_i$, $y_i = C_i h_i + D x_i$ gives
$y_i = \sum_{j \le i} \alpha_{ij} x_j + D x_i$ with a causal, data-dependent matrix $\alpha$:

* Mamba-1 / S6, one matrix per inner channel $d$ (Ali, Zimerman & Wolf 2024, "The Hidden Attention of
  Mamba Models", arXiv 2403.01590):
  $\alpha_{d,i,j} = \sum_n C_i[n] \exp\big(A_{d,n} \sum_{k=j+1}^{i} \Delta_k[d]\big) \Delta_j[d] B_j[n]$.
* Mamba-2 / SSD, one matrix per head $h$ (scalar decay $A_h$; heads of a group share $B, C$), with the
  skip term on the diagonal as the official `materialize_mixer` (goombalab/Gather-and-Aggregate,
  `models/mixers/discrete_mamba2.py`) adds it, so that $y_i = \sum_j M_{h,i,j} x_j$ exactly:
  $M_{h,i,j} = (C_i \cdot B_j) \exp\big(A_h \sum_{k=j+1}^{i} \Delta_k[h]\big) \Delta_j[h] + [i = j]\, D_h$.
  (The official Llamba mixer feeds the scan $x / \Delta$, so its matrix has no $\Delta_j$ factor; Hugging
  Face's Mamba-2 feeds $x$ and scales by $\Delta$ inside, so ours has it. Both give the same $y$.)

Both are zero for $j > i$. Bick, Xing & Gu (ICML 2025, "Understanding the Skill Gap in Recurrent Language
Models: The Role of the Gather-and-Aggregate Mechanism", arXiv 2504.18574) plot such matrices to compare
SSM Gather/Aggregate heads with attention heads. Unlike softmax attention the matrices omit the causal
conv1d (a 4-token local mix before the SSM), the gate $z$ and `out_proj` (and, for Mamba-1, the skip
term $D x_i$, as Ali et al. define it); entries can be negative and rows do not sum to 1, so compare
patterns after normalisation.

Heads and the norm: on Hugging Face's Mamba-2 the head output goes through a *gated RMSNorm* (over all the
heads of a group) before `out_proj`, so removing a head by zeroing its `out_proj` columns (the official
operator) acts after the norm — a post-norm ablation; the other heads keep the normalisation that the
removed head's output contributed to. It equals removing the head's output $y_h$ itself only on a
norm-free mixer such as the official Llamba `DiscreteMamba2` (`out_proj(y * silu(z))`).

Works on Hugging Face `Mamba2Mixer` (and Bamba hybrids' `BambaMixer`) / `MambaMixer` (transformers 5.x) by
replaying their torch forward up to the scan; `mixer_output_from_attention` rebuilds the mixer output from the
matrix as a check.
`attention` gives any layer's matrices, softmax attention or hidden attention, for the head explorer.
Shape letters: B batch, T tokens, H heads, P head dim, N state, D inner channels (the variables `B`, `C`
are the SSM's input/output projections, `D` its skip weight). Padding masks are not supported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.bamba.modeling_bamba import BambaMixer
from transformers.models.mamba.modeling_mamba import MambaMixer
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

from lab.models import hooks

MAMBA2 = (Mamba2Mixer, BambaMixer)  # Bamba hybrids' Mamba-2 mixer: the same parameters and scan


def segsum(a: Tensor) -> Tensor:
    r"""Segment sums $S_{ij} = \sum_{k=j+1}^{i} a_k$ for $j \le i$ and $-\infty$ above the diagonal,
    so `exp(segsum(a))` is the causal decay matrix. Built by a masked cumulative sum (no difference of
    two long prefix sums, which would cancel catastrophically). (..., T) -> (..., T, T)."""
    T = a.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=a.device).tril()  # j <= i
    # entry [k, j] holds a_k where k > j; summing down the rows k <= i gives S[i, j]
    S = a[..., None].expand(*a.shape, T).masked_fill(~causal.tril(-1), 0).cumsum(-2)  # (..., T, T)
    return S.masked_fill(~causal, -torch.inf)


def _conv_act(mixer: nn.Module, u: Tensor) -> Tensor:
    """Causal depthwise conv1d then the layer's activation, as `causal_conv1d_fn`: (B, T, C) -> (B, T, C)."""
    T = u.shape[1]
    return mixer.act(mixer.conv1d(u.transpose(1, 2))[..., :T]).transpose(1, 2)


def mamba2_hidden_attention(mixer: Mamba2Mixer, hidden_states: Tensor) -> tuple[Tensor, dict]:
    r"""SSD matrices $M_{h,i,j} = (C_i \cdot B_j)\, e^{A_h \sum_{k=j+1}^{i} \Delta_k[h]}\, \Delta_j[h] + [i=j]\, D_h$
    of a `Mamba2Mixer` for its input `hidden_states` (B, T, d_model): the scan's output is exactly
    $y_i = \sum_j M_{h,i,j} x_j$, the skip $D_h x_i$ on the diagonal as in the official `materialize_mixer`.
    Returns M (B, H, T, T) in float32 and the parts `x` (B, T, H, P), `z` (B, T, H·P), `dt` (B, T, H),
    `A` (H,), `B`, `C` (B, T, H, N), `D` (H,)."""
    H, P, G, N = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    b, T, _ = hidden_states.shape
    # in_proj -> gate z, conv input (x, B, C), raw time step
    z, xBC, dt = mixer.in_proj(hidden_states).split([mixer.intermediate_size, mixer.conv_dim, H], dim=-1)
    x, B, C = _conv_act(mixer, xBC).split([mixer.intermediate_size, G * N, G * N], dim=-1)
    x = x.reshape(b, T, H, P)  # (B, T, H, P)
    # heads h = g·(H/G) + r read the B, C of their group g
    B = B.reshape(b, T, G, N).float().repeat_interleave(H // G, dim=2)  # (B, T, H, N)
    C = C.reshape(b, T, G, N).float().repeat_interleave(H // G, dim=2)  # (B, T, H, N)
    # Δ = clamp(softplus(dt + dt_bias), time_step_limit), A = -exp(A_log)
    dt = F.softplus(dt.float() + mixer.dt_bias.float()).clamp(*mixer.time_step_limit)  # (B, T, H)
    A = -torch.exp(mixer.A_log.float())  # (H,)
    L = torch.exp(segsum(A[:, None] * dt.transpose(1, 2)))  # (B, H, T, T) decay e^{A_h Σ Δ_k}
    CB = torch.einsum("bihn,bjhn->bhij", C, B)  # (B, H, T, T)
    M = CB * L * dt.transpose(1, 2)[:, :, None, :]  # (B, H, T, T), times Δ_j on the columns
    M = M + torch.diag_embed(mixer.D.float()[:, None].expand(H, T))  # the skip D_h on the diagonal
    return M, {"x": x, "z": z, "dt": dt, "A": A, "B": B, "C": C, "D": mixer.D}


def mamba1_hidden_attention(mixer: MambaMixer, hidden_states: Tensor) -> tuple[Tensor, dict]:
    r"""Hidden attention $\alpha_{d,i,j} = \sum_n C_i[n]\, e^{A_{d,n} \sum_{k=j+1}^{i} \Delta_k[d]}\,
    \Delta_j[d] B_j[n]$ of a `MambaMixer` (Ali et al. 2024), one matrix per inner channel d.
    Returns alpha (B, D, T, T) in float32 and the parts `x`, `z`, `dt` (B, T, D), `A` (D, N),
    `B`, `C` (B, T, N), `D` (D,). Memory is O(B·D·T²), not O(B·D·T²·N)."""
    N, R = mixer.ssm_state_size, mixer.time_step_rank
    x, z = mixer.in_proj(hidden_states).chunk(2, dim=-1)  # (B, T, D) each
    x = _conv_act(mixer, x)  # (B, T, D) post-conv, post-activation
    dt_r, B, C = mixer.x_proj(x).split([R, N, N], dim=-1)  # (B, T, R), (B, T, N), (B, T, N)
    dt = F.softplus(mixer.dt_proj(dt_r).float())  # Δ (B, T, D)
    A = -torch.exp(mixer.A_log.float())  # (D, N)
    CB = torch.einsum("bin,bjn->bnij", C.float(), B.float())  # (B, N, T, T), C_i[n] B_j[n]
    delta = dt.transpose(1, 2)  # (B, D, T)
    # sum over the state index n in a loop, one (B, D, T, T) decay at a time
    alpha = sum(CB[:, n, None] * torch.exp(segsum(A[:, n, None] * delta)) for n in range(N))  # (B, D, T, T)
    alpha = alpha * delta[:, :, None, :]  # (B, D, T, T), times Δ_j on the columns
    return alpha, {"x": x, "z": z, "dt": dt, "A": A, "B": B, "C": C, "D": mixer.D}


def mixer_output_from_attention(mixer: Mamba2Mixer | MambaMixer, attn: Tensor, parts: dict) -> Tensor:
    r"""Rebuild the mixer output from its matrix: $y_i = \sum_j \mathrm{attn}_{ij} x_j$ (Mamba-2, whose
    matrix holds $D$ on its diagonal) or $\sum_j \mathrm{attn}_{ij} x_j + D x_i$ (Mamba-1), then the gate
    (Mamba-2: gated RMSNorm of $y \cdot \mathrm{silu}(z)$; Mamba-1: $y \cdot \mathrm{silu}(z)$) and `out_proj`.
    Returns (B, T, d_model) in the model's dtype; equals `mixer(hidden_states)` up to rounding."""
    x, z, D = parts["x"].float(), parts["z"], parts["D"].float()
    if isinstance(mixer, MAMBA2):
        y = torch.einsum("bhij,bjhp->bihp", attn, x)  # (B, T, H, P), the skip included
        y = mixer.norm(y.flatten(2), z)  # (B, T, H·P), groups of H·P / n_groups channels
    elif isinstance(mixer, MambaMixer):
        y = torch.einsum("bdij,bjd->bid", attn, x) + D * x  # (B, T, D)
        y = y * F.silu(z.float())  # (B, T, D)
    else:
        raise TypeError(f"expected a Mamba2Mixer or MambaMixer, got {type(mixer).__name__}")
    return mixer.out_proj(y.to(z.dtype))


@torch.no_grad()
def hidden_attention(model: nn.Module, input_ids: Tensor, layer: int) -> Tensor:
    """Hidden attention of layer `layer` of a `Mamba2ForCausalLM` / `MambaForCausalLM` (or base model) on
    `input_ids` (B, T): captures the mixer input (`lab.models.hooks`) during one forward, returns
    (B, heads, T, T) float32 (heads = Mamba-2 heads, or Mamba-1 inner channels)."""
    mixer = hooks.mixer(model, layer)
    _, (h,) = hooks.run_with_cache(model, [mixer], input_ids=input_ids, use_cache=False)
    if isinstance(mixer, MAMBA2):
        return mamba2_hidden_attention(mixer, h)[0]
    if isinstance(mixer, MambaMixer):
        return mamba1_hidden_attention(mixer, h)[0]
    raise TypeError(f"layer {layer} has a {type(mixer).__name__}, not a Mamba2Mixer or MambaMixer")


@torch.no_grad()
def attention(model: nn.Module, input_ids: Tensor, layer: int) -> Tensor:
    """Every head's (hidden-)attention matrix of one layer of any causal LM: (B, H, T, T).

    Softmax attention for attention layers (eager attention); for Mamba-1/2 the SSM's hidden
    attention (`hidden_attention`), which reproduces the layer's scan output."""
    if hooks.is_attention(model, layer):
        out = model(input_ids=input_ids, output_attentions=True, use_cache=False)
        n = len(hooks.layers(model))
        if len(out.attentions) < n:  # a hybrid returns its attention blocks' matrices only
            layer = [i for i in range(n) if hooks.is_attention(model, i)].index(layer)
        return out.attentions[layer].float()
    return hidden_attention(model, input_ids, layer)
