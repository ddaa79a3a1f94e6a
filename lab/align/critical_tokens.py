r"""cDPO's ground truth and its check — Lin, Liang, Xu et al., "Critical Tokens Matter", ICML 2025 (arXiv
2411.19943; code: chenzhiling9954/Critical-Tokens-Matter), §2 and §3.1.

(a) **Critical tokens by rollouts** (§2). For an incorrect trajectory y, roll out K continuations from every
proper prefix y_≤t (t < L − 1; the official rollout sampling also leaves out the full trajectory); c_t is the
share that end correct. The critical token is the first t with c_t = 0 and c_t' < 5% for all t' > t (none if no
prefix has c_t = 0). Replacing it (mask y_t, resample, roll out) recovers Pass@k (Fig. 2).

(b) **Does contrastive estimation find it?** `ce_agreement` scores argmin_t s_t of `lab.align.cdpo.ce_scores`
(and its named wrong variants) against the rollout critical token. The loss, selection and training pipeline
live in `lab.align.cdpo`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lab.align.cdpo import CONTROLS, Grade, ce_scores
from lab.core.params import check_control
from lab.core.stages import stage
from lab.models.sample import mean_pass_at_k, sample


def critical_or_random(c: Tensor, control: str = "", *, generator: torch.Generator | None = None) -> Tensor:
    """`critical_token(c)`, or under the `random_token` control a uniformly random position per row."""
    if check_control(control, CONTROLS) == "random_token":
        return torch.randint(c.shape[-1], c.shape[:-1], generator=generator)
    return critical_token(c)


@stage
def rollout_correctness(model, prompts: Tensor, responses: Tensor, grade: Grade, *, K: int,
                        generator: torch.Generator, temperature: float = 1.0) -> Tensor:
    """c (n, L − 1): c[i, t] = share of K rollouts from prompt + y_≤t that are correct, for the proper prefixes
    t < L − 1 only: the full trajectory is not graded as its own rollout (the official rollout sampling also stops
    one token short), so a wrong y does not force a critical token at its last position."""
    n, L = responses.shape
    c = torch.zeros(n, L - 1)
    for t in range(L - 1):
        head = responses[:, : t + 1].repeat_interleave(K, 0)  # (n·K, t+1)
        prefix = torch.cat([prompts.repeat_interleave(K, 0), head.to(prompts.device)], 1)
        tail = sample(model, prefix, L - t - 1, generator=generator, temperature=temperature)
        c[:, t] = grade(torch.arange(n), torch.cat([head.cpu(), tail], 1).view(n, K, L)).float().mean(1)
    return c


def critical_token(c: Tensor, *, tol: float = 0.05) -> Tensor:
    """(n,) the first t with c_t = 0 and c_t' < tol for all t' > t (the paper's rule; the code's
    "reset if a later prefix has > 3/64 correct" is tol = 3/64 with ≤); −1 where there is none. Documented
    difference: after such a reset the official rule falls back to the last prefix it had found
    (`rollout_sampling_for_critical_tokens.py`, `last_min_predix`); here that trajectory has none (−1)."""
    later = torch.cat([c.flip(-1).cummax(-1).values.flip(-1)[..., 1:], torch.zeros(*c.shape[:-1], 1)], -1)
    ok = (c == 0) & (later < tol)
    return torch.where(ok.any(-1), ok.float().argmax(-1), -1)


@stage
def replacement(model, prompts: Tensor, responses: Tensor, t: Tensor, grade: Grade, *, K: int,
                generator: torch.Generator, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Correct (n, K) rollouts with y_t kept and with y_t replaced (masked out, resampled) (Fig. 2)."""
    n, L = responses.shape
    kept, swapped = torch.zeros(n, K, dtype=torch.bool), torch.zeros(n, K, dtype=torch.bool)
    for tt in t.unique().tolist():
        rows = (t == tt).nonzero()[:, 0]
        for out, upto, ban in ((kept, tt + 1, None), (swapped, tt, responses[rows, tt])):
            head = responses[rows, :upto].repeat_interleave(K, 0)
            prefix = torch.cat([prompts[rows].repeat_interleave(K, 0), head.to(prompts.device)], 1)
            tail = sample(model, prefix, L - upto, generator=generator, temperature=temperature,
                          ban=None if ban is None else ban.repeat_interleave(K, 0))
            full = torch.cat([head.cpu(), tail], 1).view(len(rows), K, L)
            out[rows] = grade(rows, full)
    return kept, swapped


KS = (1, 2, 4, 8, 16, 32, 64)  # the k of Pass@k, up to K


@dataclass
class Rollouts:
    """The rollout ground truth (§2, Fig. 2) on rejected trajectories (m, L)."""

    c: Tensor  # (m, L − 1) share of K rollouts from each proper prefix y_≤t that end correct
    critical: Tensor  # (m,) the critical token (−1: none), or the control's random position
    found: Tensor  # (m,) critical ≥ 0
    ks: list[int]
    pass_k: dict[str, list[float]]  # mean Pass@k with the critical token kept / replaced
    positions: list[int]  # critical tokens found at each response position
    on_operation: float  # share of all m trajectories whose critical token is found at an operation position


def rollout_study(model, prompts: Tensor, rejected: Tensor, grade: Grade, *, K: int, operations: tuple[int, ...],
                  control: str = "", generator: torch.Generator, device: str = "cpu") -> Rollouts:
    """c_t by K rollouts per proper prefix, the critical token (`critical_or_random`), the replacement test at
    it, and the share of trajectories whose critical token sits at one of the `operations` positions."""
    c = rollout_correctness(model, prompts.to(device), rejected.to(device), grade, K=K, generator=generator)
    crit = critical_or_random(c, control, generator=generator)
    found = crit >= 0
    rows = found.nonzero()[:, 0]
    kept, swapped = replacement(model, prompts[rows].to(device), rejected[rows].to(device), crit[rows],
                                lambda r, y: grade(rows[r], y), K=K, generator=generator)
    ks = [k for k in KS if k <= K]
    none = [float("nan")] * len(ks)  # no critical token found: no replacement test
    pass_k = {"critical token kept": mean_pass_at_k(kept, ks) if len(rows) else none,
              "critical token replaced": mean_pass_at_k(swapped, ks) if len(rows) else none}
    on_op = torch.isin(crit, torch.tensor(operations, dtype=crit.dtype)).float().mean().item()
    return Rollouts(c, crit, found, ks, pass_k, torch.bincount(crit[found], minlength=rejected.shape[1]).tolist(),
                    on_op)


def ce_agreement(pos, neg, s: Tensor, prompts: Tensor, rejected: Tensor, chosen: Tensor, study: Rollouts, *,
                 beta: float, free: Tensor | None = None, device: str = "cpu") -> dict[str, float]:
    """Top-1 agreement with the rollout critical token (where one was found) of argmin_t s_t, of P_p alone (β = 0),
    of the named wrong variants (β's sign flipped, P_p / P_n swapped) and of the heuristic "first token where
    rejected leaves chosen", skipping positions where either holds one of the `free` token ids (the toy's wording
    tokens, which would otherwise make it land on the wording by construction)."""
    def hit(t: Tensor) -> float:
        return (t == study.critical)[study.found].float().mean().item()

    x, y = prompts.to(device), rejected.to(device)
    differ = chosen != rejected
    if free is not None:
        differ &= ~(torch.isin(chosen, free) | torch.isin(rejected, free))
    return {f"CE (β = {beta:g})": hit(s.argmin(1)),
            "P_p alone (β = 0)": hit(ce_scores(pos, neg, x, y, beta=0.0).argmin(1)),
            "β sign flipped": hit(ce_scores(pos, neg, x, y, beta=-beta).argmin(1)),
            "P_p / P_n swapped": hit(ce_scores(neg, pos, x, y, beta=beta).argmin(1)),
            "first differing non-wording token": hit(differ.float().argmax(1))}


def critical_focus(drop: Tensor, study: Rollouts) -> float:
    """How much more training lowered the rollout critical token than the rest of its rejected trajectory: over the
    trajectories with one, the mean of drop[t*] − mean_{t ≠ t*} drop[t] (nats), from `drop` (m, L) = log π_ref(y_t|·)
    − log π_θ(y_t|·) on the first m rejected trajectories (`lab.align.cdpo.arm_sweep`'s "rejected_drop")."""
    rows = study.found.nonzero()[:, 0]
    d, t = drop[rows], study.critical[rows]
    at = d.gather(1, t[:, None])[:, 0]
    return (at - (d.sum(1) - at) / (d.shape[1] - 1)).mean().item()
