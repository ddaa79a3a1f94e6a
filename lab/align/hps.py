r"""HPS — Zou, Lin, Li & Zhou, "HPS: Hard Preference Sampling for Human Preference Alignment",
ICML 2025 (arXiv 2502.14400; code: LVLab-SMU/HPS, `dpo_iteration/run_dpo.py`).

Each prompt has n responses with annotated rewards r*. HPS prefers the best response over *all*
dispreferred ones, weighting a dispreferred response by its hardness, p_γ(y) ∝ exp(γ·r*(y)) over the
responses below the best (Robinson et al. 2020 hard negatives); a single Monte Carlo draw ỹ ~ p_γ
replaces the expectation (2 sequences per prompt instead of n for Plackett–Luce):

    paper form:  −log σ(β·Δh − log(n−1))        Δh = h(y_best) − h(ỹ)
    code form:   −log σ(β·Δh)                   (what the released code trains: DPO on the pair)

γ follows the official curriculum (`hard_i`): γ_i = −5 + 10·i/(N−1) over N data chunks, easy to
hard negatives. Fixed from the official code: the sampler subtracts the max before exp (the code's
exp(γ·r) overflows once γ·r > 709), γ is initialised before use (the code raises UnboundLocalError
in its default config), and "hard" means γ > 0 (the code's `hard` setting uses γ = −5: easy).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def hardness_weights(r: Tensor, gamma: float) -> Tensor:
    """p_γ over the dispreferred responses of each row: softmax(γ·r) on responses whose reward is
    below the row's max (ties with the best are excluded), 0 elsewhere: (B, n) -> (B, n)."""
    r = r.double()
    negative = r < r.max(-1, keepdim=True).values  # (B, n)
    if not negative.any(-1).all():
        raise ValueError("a prompt has no response below its best; skip single-candidate or all-tied prompts.")
    logits = (gamma * r).masked_fill(~negative, -math.inf)
    return torch.softmax(logits, -1)  # max-subtracted inside softmax: no overflow


def sample_negative(r: Tensor, gamma: float, generator: torch.Generator | None = None) -> Tensor:
    """One hardness-weighted dispreferred index per row (the single-sample MC estimator): (B,)."""
    return torch.multinomial(hardness_weights(r, gamma), 1, generator=generator)[:, 0]


def gamma_schedule(i: int, n_chunks: int = 5, *, start: float = -5.0, end: float = 5.0) -> float:
    """The official `hard_i` curriculum: γ at data chunk i of N, linear from `start` to `end`."""
    return start + (end - start) * i / max(1, n_chunks - 1)


def hps(pi: Tensor, ref: Tensor, *, beta: float = 0.25, r: Tensor, gamma: float = 5.0,
        generator: torch.Generator | None = None, normalizer: bool = True) -> Tensor:
    """HPS on (B, n) log-probs with annotated rewards `r` (B, n): the best response (by r) against one
    negative drawn from p_γ. `normalizer=True` is the paper form (−log(n−1) inside the sigmoid),
    False the released code's plain DPO on the pair. With n = 2 both reduce to DPO."""
    best = r.argmax(-1)  # (B,)
    neg = sample_negative(r, gamma, generator)  # (B,)
    h = pi - ref
    rows = torch.arange(len(h))
    z = beta * (h[rows, best] - h[rows, neg])
    if normalizer:
        z = z - math.log(h.shape[1] - 1)
    return F.softplus(-z)
