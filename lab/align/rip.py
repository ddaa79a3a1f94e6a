r"""RIP — Yu, Yuan, Golovneva, Wu, Sukhbaatar, Weston & Xu, "R.I.P.: Better Models by Survival of the
Fittest Prompts", ICML 2025 (arXiv 2501.18578; no official code; third-party: LumiOpen/rip).

Low-quality prompts show in the *rejected* response of a best-vs-worst pair (§3): sample N responses
per prompt, score them, y_w = argmax r, y_l = argmin r, and compute per prompt

    m1 = r(y_l | x)              rejected reward      keep if ≥ τ1
    m2 = len(y_l)                rejected length      keep if ≥ τ2
    m3 = r(y_w | x) − r(y_l | x)  reward gap           keep if ≤ τ3   (small gaps: Table 10's "> 0.042" is a typo)

with τ the q-th percentiles of each metric over the whole pool, computed once (50/50/50 in the best 8B
run), and a prompt kept only if all three hold. Surviving pairs go unchanged into DPO. Pairs with
r_w = r_l carry no preference and are dropped from the pool before the percentiles (the paper assumes
r_w > r_l; with discrete toy rewards ties are common). Self-RIP post-filters synthetic prompts with the
same thresholds (`keep(..., tau)` on a new pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Pool:
    """Per-prompt best-vs-worst pairs and their metrics (all (Q,))."""

    w: Tensor  # index of the chosen (best) sample
    l: Tensor  # index of the rejected (worst) sample
    chosen_reward: Tensor
    m1: Tensor  # rejected reward
    m2: Tensor  # rejected length
    m3: Tensor  # reward gap
    valid: Tensor  # r_w > r_l


def best_vs_worst(r: Tensor, length: Tensor) -> Pool:
    """From rewards r (Q, N) and response lengths (Q, N): the pairs and the three RIP metrics. Among
    equally rewarded worst samples the shortest is the rejected one (ties broken towards the signal)."""
    Q = torch.arange(len(r))
    w = r.argmax(1)
    key = r * (length.max() + 1) + length  # lexicographic: lowest reward, then shortest
    l = key.argmin(1)
    rw, rl = r[Q, w], r[Q, l]
    return Pool(w, l, rw, rl, length[Q, l].float(), rw - rl, rw > rl)


def thresholds(pool: Pool, q: tuple[float, float, float] = (0.5, 0.5, 0.5)) -> tuple[float, float, float]:
    """τ1, τ2, τ3: the q-quantiles of m1, m2, m3 over the valid pairs of the whole pool."""
    v = pool.valid
    if not v.any():
        raise ValueError("no valid pair (r_w > r_l) in the pool: nothing to filter.")
    return tuple(torch.quantile(m[v], qq).item() for m, qq in zip((pool.m1, pool.m2, pool.m3), q))


def keep(pool: Pool, tau: tuple[float, float, float]) -> Tensor:
    """The RIP filter (Q,) bool: m1 ≥ τ1 AND m2 ≥ τ2 AND m3 ≤ τ3, valid pairs only."""
    t1, t2, t3 = tau
    return pool.valid & (pool.m1 >= t1) & (pool.m2 >= t2) & (pool.m3 <= t3)


CONTROLS = {"random_filter": "RIP's filter replaced by a uniformly random subset of the valid pairs of the same size "
                             "(on the pool and in Self-RIP's post-filter)"}


def rip_filter(pool: Pool, tau: tuple[float, float, float], control: str = "",
               generator: torch.Generator | None = None) -> Tensor:
    """The filter the notebook applies as RIP: `keep(pool, tau)`, or under the `random_filter` control a
    random subset of the valid pairs with as many members as RIP keeps (needs `generator`)."""
    if control and control not in CONTROLS:
        raise ValueError(f"unknown control {control!r}; known: {', '.join(CONTROLS)}")
    kept = keep(pool, tau)
    if control == "random_filter":
        return random_subset(pool.valid, int(kept.sum()), generator)
    return kept


def single_filters(pool: Pool, q: float = 0.5) -> dict[str, Tensor]:
    """The coordinate-wise filters of Table 20 and the chosen-based baseline, each at its own
    q-quantile over the valid pool; `large gap` keeps the other half of the gap condition."""
    v = pool.valid

    def at(m):
        return torch.quantile(m[v], q).item()

    return {"rejected reward only": v & (pool.m1 >= at(pool.m1)),
            "rejected length only": v & (pool.m2 >= at(pool.m2)),
            "small gap only": v & (pool.m3 <= at(pool.m3)),
            "chosen reward only": v & (pool.chosen_reward >= at(pool.chosen_reward)),
            "large gap": v & (pool.m3 > at(pool.m3))}


def random_subset(valid: Tensor, size: int, generator: torch.Generator) -> Tensor:
    """A uniformly random subset of the valid pairs with `size` members (the equal-size control)."""
    idx = valid.nonzero()[:, 0]
    out = torch.zeros_like(valid)
    out[idx[torch.randperm(len(idx), generator=generator)[:size]]] = True
    return out


def bad_fraction(mask: Tensor, bad: Tensor) -> float:
    """Share of low-quality prompts in a kept set (nan when the set is empty)."""
    return bad[mask].float().mean().item() if mask.any() else float("nan")
