r"""The DPO-family preference losses, with one signature.

Every loss takes the sequence log-probs of the policy and of the frozen reference for n responses
per example and returns the per-example loss:

    loss(pi, ref, *, beta, ...) -> (B,)        pi, ref: (B, n) = log π_θ(y_k|x), log π_ref(y_k|x)

Column 0 is the preferred response y_w; columns 1..n-1 are dispreferred, ranked best first (listwise
losses use the ranking; pairwise losses need n = 2). The implicit reward is h_θ = log π_θ − log π_ref.
Options are keyword-only; unknown options are errors. Registered by name in `lab.align.LOSSES`.

- DPO (Rafailov et al. 2023):           −log σ(β·Δh)                 (ε > 0: conservative/cDPO labels)
- IPO (Azar et al. 2024):               (Δh − 1/(2β))²
- f-DPO, Jensen–Shannon (Wang et al. 2024): −log σ(β·Δg), g = log 2π_θ − log(π_θ + π_ref)
- RPO (Pang et al. 2024):               DPO + α·NLL(y_w) (per token when `chosen_len` is given)
- Plackett–Luce listwise DPO (DPO paper App. A.3; HPS's PL baseline): −Σ_k log softmax_{j≥k}(β h_j)[k]
- TDPO (Zeng et al. 2024, "Token-level Direct Preference Optimization"): −log σ(β·[Δh − δ]) with the responses'
  sequential KLs D = Σ_t KL(π_ref(·|x, y_<t) ‖ π_θ(·|x, y_<t)) (`kl`, (B, 2); `lab.align.train.sequential_kl`):
  TDPO1 δ = D_l − D_w, TDPO2 δ = α·(D_l − sg(D_w))
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def implicit_reward(pi: Tensor, ref: Tensor) -> Tensor:
    """h_θ(x, y) = log π_θ(y|x) − log π_ref(y|x): (B, n)."""
    return pi - ref


def _pair(pi: Tensor, ref: Tensor) -> tuple[Tensor, Tensor]:
    if pi.shape != ref.shape or pi.ndim != 2 or pi.shape[1] != 2:
        raise ValueError(f"a pairwise loss needs pi and ref of shape (B, 2); got {tuple(pi.shape)} and "
                         f"{tuple(ref.shape)}.")
    return pi, ref


def dpo(pi: Tensor, ref: Tensor, *, beta: float = 0.1, label_smoothing: float = 0.0) -> Tensor:
    """−(1−ε)·log σ(βΔh) − ε·log σ(−βΔh), Δh = h(y_w) − h(y_l); ε = 0 is DPO."""
    h = implicit_reward(*_pair(pi, ref))
    z = beta * (h[:, 0] - h[:, 1])  # (B,)
    return (1 - label_smoothing) * F.softplus(-z) + label_smoothing * F.softplus(z)


def ipo(pi: Tensor, ref: Tensor, *, beta: float = 0.1) -> Tensor:
    """(Δh − 1/(2β))²: regresses the implicit reward gap to a finite target."""
    h = implicit_reward(*_pair(pi, ref))
    return (h[:, 0] - h[:, 1] - 1 / (2 * beta)) ** 2


def fdpo_js(pi: Tensor, ref: Tensor, *, beta: float = 0.1) -> Tensor:
    """f-DPO with the Jensen–Shannon divergence: −log σ(β·[g(y_w) − g(y_l)]),
    g(y) = log 2π_θ(y) − log(π_θ(y) + π_ref(y)) (as in EXPO's official code)."""
    pi, ref = _pair(pi, ref)
    g = math.log(2) + pi - torch.logaddexp(pi, ref)  # (B, 2)
    return F.softplus(-beta * (g[:, 0] - g[:, 1]))


def rpo(pi: Tensor, ref: Tensor, *, beta: float = 0.1, alpha: float = 1.0,
        chosen_len: Tensor | None = None) -> Tensor:
    """DPO + α·NLL of the chosen response (per token when `chosen_len` (B,) is given)."""
    nll = -pi[:, 0] if chosen_len is None else -pi[:, 0] / chosen_len
    return dpo(pi, ref, beta=beta) + alpha * nll


def plackett_luce(pi: Tensor, ref: Tensor, *, beta: float = 0.1) -> Tensor:
    """Listwise: −Σ_{k=1}^{n−1} log [exp(βh_k) / Σ_{j≥k} exp(βh_j)] over the ranked columns."""
    if pi.shape != ref.shape or pi.ndim != 2 or pi.shape[1] < 2:
        raise ValueError(f"a listwise loss needs pi and ref of shape (B, n >= 2); got {tuple(pi.shape)}.")
    s = beta * implicit_reward(pi, ref)  # (B, n)
    # log Σ_{j≥k} exp(s_j) for every k: reverse cumulative logsumexp
    tail = torch.logcumsumexp(s.flip(-1), -1).flip(-1)  # (B, n)
    return (tail - s)[:, :-1].sum(-1)


def tdpo(pi: Tensor, ref: Tensor, *, beta: float = 0.1, kl: Tensor | None = None, alpha: float = 0.5,
         tdpo2: bool = True) -> Tensor:
    """TDPO's loss −log σ(β·(Δh − δ)) from the sequence log-probs and the sequential KLs `kl` (B, 2) of the chosen
    and the rejected response, D_SeqKL(x, y; π_ref ‖ π_θ). TDPO1: δ = D_l − D_w; TDPO2 (the paper's recommended
    form and the official `tdpo_loss` default, α = 0.5): δ = α·(D_l − D_w) with no gradient through D_w. (The
    official config file sets `if_tdpo2: false`; its README runs TDPO2 with α = 0.5, β = 0.1.)"""
    h = implicit_reward(*_pair(pi, ref))
    if kl is None or kl.shape != pi.shape:
        raise ValueError(f"tdpo needs kl of the shape of pi, (B, 2); got {None if kl is None else tuple(kl.shape)}.")
    delta = alpha * (kl[:, 1] - kl[:, 0].detach()) if tdpo2 else kl[:, 1] - kl[:, 0]
    return F.softplus(-beta * (h[:, 0] - h[:, 1] - delta))
