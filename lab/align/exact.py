"""Exact enumeration of a tiny LM's response space: every response of length L over V tokens is
scored, so distributions, KLs and win rates over responses are computed exactly (no sampling).
Shared by the preference toys (EXPO's and InfAlign's tiny-transformer tests)."""

from __future__ import annotations

import torch
from torch import Tensor


def all_sequences(V: int, L: int) -> Tensor:
    """Every response of length L over V tokens: (V^L, L)."""
    return torch.cartesian_prod(*[torch.arange(V)] * L).reshape(-1, L)


def seq_logprobs(model, prompts: Tensor, seqs: Tensor, V: int) -> Tensor:
    """log π(y | x) for every prompt token x (C,) and response y: (C, S). `seqs` is (S, L), shared
    by the prompts, or (C, S, L), one set per prompt. The next-token softmax is over the V response
    tokens (ids 0..V-1) only, so all V^L responses exhaust the space and distributions are exact."""
    C, (S, L) = len(prompts), seqs.shape[-2:]
    seqs = seqs.expand(C, S, L)
    x = torch.cat([prompts[:, None, None].expand(C, S, 1), seqs], -1).reshape(C * S, L + 1)
    logp = model(input_ids=x).logits[:, :-1, :V].log_softmax(-1)  # (C·S, L, V)
    return logp.gather(-1, x[:, 1:, None])[..., 0].sum(-1).reshape(C, S)


def fit_exact(model, prompts: Tensor, seqs: Tensor, target_logp: Tensor, V: int, *, steps: int,
              lr: float) -> list[float]:
    """SFT by enumeration: minimize KL(target ‖ π_model) per prompt with Adam; returns the KLs."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    p = target_logp.exp()
    out = []
    for _ in range(steps):
        kl_ = (p * (target_logp - seq_logprobs(model, prompts, seqs, V))).sum(-1).mean()
        kl_.backward()
        opt.step()
        opt.zero_grad()
        out.append(kl_.item())
    return out


def _tail_probs(p: Tensor, N: int, kind: str) -> Tensor:
    """Probability of each (sorted, unique-reward) group under BoN / WoN of N draws: (G,)."""
    F = p.cumsum(0).clamp(max=1.0)
    F_minus = F - p
    if N == 1:
        return p
    if kind == "bon":
        return F ** N - F_minus ** N
    return (1 - F_minus) ** N - (1 - F) ** N


def win_rate(logp: Tensor, ref_logp: Tensor, r: Tensor, N: int = 1, kind: str = "bon") -> Tensor:
    """Exact win rate of T(π) against T(π_ref) under reward r, ties counted ½, per prompt: (C,).

    logp, ref_logp, r: (C, S) over the enumerated responses; T is BoN or WoN of N draws (N = 1: plain)."""
    out = []
    for c in range(len(r)):
        values, group = torch.unique(r[c], return_inverse=True)  # ascending reward groups
        P = torch.zeros(len(values), dtype=torch.float64).index_add_(0, group, logp[c].double().exp())
        Q = torch.zeros(len(values), dtype=torch.float64).index_add_(0, group, ref_logp[c].double().exp())
        PT, QT = _tail_probs(P, N, kind), _tail_probs(Q, N, kind)
        below = QT.cumsum(0) - QT  # P_ref_T(reward < this group)
        out.append((PT * (below + 0.5 * QT)).sum())
    return torch.stack(out)


def train_rlhf(policy, prompts: Tensor, seqs: Tensor, ref_logp: Tensor, R: Tensor, beta: float, V: int, *,
               steps: int, lr: float) -> Tensor:
    """Maximize the exact KL-regularized objective Σ_y π_θ(y)[R(y) − β(log π_θ(y) − log π_ref(y))],
    averaged over prompts, with Adam. Returns log π_θ (C, S)."""
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    for _ in range(steps):
        logp = seq_logprobs(policy, prompts, seqs, V)
        loss = -(logp.exp() * (R - beta * (logp - ref_logp))).sum(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return seq_logprobs(policy, prompts, seqs, V)
