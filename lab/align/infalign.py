r"""InfAlign — Balashankar, Sun et al., "InfAlign: Inference-aware language model alignment",
ICML 2025 (arXiv 2412.19792; no official code).

Aligned models are decoded with inference-time procedures T — Best-of-N (BoN), or Worst-of-N (WoN,
the jailbreak view of a safety reward) — yet RLHF optimizes the plain win rate. InfAlign maximizes
the win rate of T(π) against T(π_ref) under a KL budget; its optimum is RLHF with a *transformed*
reward. CTRL (calibrate-and-transform): (1) calibrate the reward to its quantile among base-policy
samples for the same prompt, C(x, y) = P_{y'~π_ref}(r(x,y') < r(x,y)) + ½P(=) ∈ [0, 1]; (2) apply
Φ_t(u) = exp(t·u) for BoN or −exp(−t·u) for WoN; (3) KL-regularized RL on Φ_t(C).

The *analytical tool* (derivations for this lab, labelled as such in the notebook): when the tilted
policy depends on y only through u = C, u ~ U[0, 1] under π_ref, and π ∝ π_ref·exp(Φ(u)/β) induces
on [0, 1] the density q(u) = exp(Φ(u)/β)/Z with KL(π‖π_ref) = ∫ q log q. With F the CDF of q:

    W_1 = ∫ u q(u) du      W_BoN = 1 − ∫ N u^{N−1} F(u)^N du      W_WoN = 1 − ∫ N (1−u)^{N−1} (1 − (1−F(u))^N) du

and the optimal transformed reward is the fixed point R = R[q*] (BoN: R(w) = −N² ∫_w^1 v^{N−1} F(v)^{N−1} dv;
WoN: −N² ∫_w^1 (1−v)^{N−1} (1−F(v))^{N−1} dv; N = 1 gives the identity). Everything is computed on a
midpoint grid of M cells in float64 (∫_w^1 from the cell's midpoint: the exact derivative of the grid's win rate).

This module holds CTRL's pieces (`calibrate`: Ĉ from K base samples per prompt, `transform`, the controls) and the
analytical tool on one prompt (claims I1, I3, I4). Where calibration has work to do, prompts whose raw rewards have
different scales (claims I2, I5, I6: the analytical tool over several prompts and a tiny transformer scored by
exact enumeration), is its companion `lab.align.infalign_scales`, kept apart for the paper module's size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

Transform = Callable[[Tensor], Tensor]  # Φ: calibrated reward u -> transformed reward


@dataclass(frozen=True)
class Config:
    M: int = 4000  # grid cells for closed forms
    M_opt: int = 2000  # grid cells for the fixed-point optimum (iterative, slower)
    opt_iters: int = 800
    budgets: tuple[float, ...] = (0.25, 0.5, 1.0)  # KL budgets (nats) where methods are compared
    settings: tuple[tuple[str, int], ...] = (("bon", 1), ("bon", 4), ("bon", 16), ("won", 4), ("won", 16))
    bon_check_Ns: tuple[int, ...] = (2, 4, 16)  # N where log-calibrated RLHF must reproduce the BoN policy
    frontier_settings: tuple[tuple[str, int], ...] = (("bon", 1), ("bon", 4), ("won", 4))  # optimum and curves
    opt_betas: tuple[float, float, int] = (-2, 0, 25)  # torch.logspace(start, end, steps): the optimum's β grid
    # (it spans KL ≈ 0.1–1.3 or more in every frontier setting: the budgets, densely enough to interpolate)
    curve_betas: tuple[float, float, int] = (-3, 2, 40)  # the same for the frontier figure (β × Φ's range)
    curve_t: float = 10.0  # the exponentials drawn in the frontier figure
    explorer_M: int = 2000  # grid cells of the live explorer
    # the analytical tool with prompts of heterogeneous reward scales (claim I2)
    het_sigmas: tuple[float, ...] = (1.0, 0.2, 0.05)  # per-prompt scale σ of a raw N(0, σ²) reward
    het_t: float = 10.0  # CTRL's exp(t·u) in that comparison
    z_ts: tuple[float, ...] = (0.1, 0.25, 0.5, 1, 2, 3, 5, 7, 10, 15, 20, 30, 40)  # the baseline exp(t·z)'s t: CTRL's
    # grid `TS` and smaller t (z spans about ±3 where u spans [0, 1]; t → 0 is the z-scored reward itself)
    # tiny transformer by exact enumeration: V^L responses, prompts with heterogeneous reward scales
    V: int = 6
    L: int = 3
    sigmas: tuple[float, ...] = (1.0, 0.3, 0.1, 3.0)  # per-prompt reward scale
    sft_steps: int = 300
    rl_steps: int = 250
    lr: float = 3e-3
    lm_kl: float = 0.5
    lm_N: int = 4
    lm_ts: tuple[float, ...] = (10.0,)  # CTRL's exp(t·u) on the tiny transformer
    cal_Ks: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256, 1024)  # base samples per prompt for the sampled Ĉ
    cal_K: int = 32  # the K of claim I6
    cal_draws: int = 8  # independent K-sample draws averaged per K

    @classmethod
    def for_scale(cls, scale: str) -> Config:
        return cls() if scale == "smoke" else cls(M=20000, M_opt=8000, opt_iters=2000, rl_steps=600)


def grid(M: int = 4000) -> Tensor:
    """Midpoints of M equal cells of [0, 1] (float64)."""
    return (torch.arange(M, dtype=torch.float64) + 0.5) / M


# ------------------------------------------------------------------------------------ the transforms

def identity(u: Tensor) -> Tensor:
    return u


def log_cal(u: Tensor) -> Tensor:
    """log u: with β = 1/(N−1) its tilt is exactly the BoN policy (density N u^{N−1})."""
    return u.log()


def raw_gaussian(u: Tensor) -> Tensor:
    """A raw N(0, 1) reward seen through its quantile: r = Φ_N^{-1}(u) (uncalibrated RLHF)."""
    return torch.special.ndtri(u)


def exp_bon(t: float) -> Transform:
    """Φ_t(u) = exp(t·u), t > 0 (for Best-of-N)."""
    return lambda u: torch.exp(t * u)


def exp_won(t: float) -> Transform:
    """Φ_t(u) = −exp(−t·u), t > 0 (for Worst-of-N); still increasing in u."""
    return lambda u: -torch.exp(-t * u)


CONTROLS = {
    "identity": "CTRL's transform Φ_t replaced by the identity on the calibrated reward (calibrated RLHF, "
                "InfAlign's own baseline), for every t and both signs",
    "swapped_sign": "CTRL's transform given the other procedure's sign: −exp(−t·u) where BoN asks for exp(+t·u) "
                    "and exp(+t·u) where WoN asks for −exp(−t·u) (still increasing: the wrong tail is stretched)",
    "global_calibration": "CTRL's per-prompt calibration replaced by the quantile against π_ref pooled over all "
                          "prompts (one CDF for every prompt; sampled: the K base samples of every prompt pooled)",
}


def check_control(control: str) -> str:
    if control and control not in CONTROLS:
        raise ValueError(f"unknown control {control!r}; known: {', '.join(CONTROLS)}")
    return control


def transform(kind: str, t: float, control: str = "") -> Transform:
    """CTRL's transform: exp(t·u) for BoN (`kind="bon"`), −exp(−t·u) for WoN; the identity under the
    `identity` control, the other kind's exponential under `swapped_sign`."""
    control = check_control(control)
    if control == "identity":
        return identity
    if control == "swapped_sign":
        kind = "won" if kind == "bon" else "bon"
    return exp_bon(t) if kind == "bon" else exp_won(t)


# -------------------------------------------------------------------------- densities and metrics

def density(phi: Transform | Tensor, beta: float | Tensor, u: Tensor) -> Tensor:
    """q(u) = exp(Φ(u)/β) / Z on the grid, normalized so that Σ q du = 1 along the last dim: (..., M). Φ given
    as values may carry leading dims (one reward per prompt), β as a tensor too (one density per β)."""
    logq = (phi(u) if callable(phi) else phi) / beta
    return (logq - torch.logsumexp(logq, -1, keepdim=True) + math.log(len(u))).exp()


def kl_to_base(q: Tensor) -> float:
    """KL(π ‖ π_ref) = KL(q ‖ U[0, 1]) = ∫ q log q du: the KL of the calibrated reward's density q on
    the grid to its density under the base policy (uniform)."""
    return float((q * q.clamp_min(1e-300).log()).mean())


def cdf(q: Tensor) -> Tensor:
    """F(u) at the grid points (midpoint rule, half of the own cell), along the last dim."""
    M = q.shape[-1]
    return (q.cumsum(-1) - q / 2) / M


def win_rate(q: Tensor, N: int = 1, kind: str = "bon") -> float:
    """Inference-time win rate of T(π) against T(π_ref): standard (N = 1), BoN or WoN."""
    u, F = grid(len(q)), cdf(q)
    if N == 1:
        return float((u * q).mean())
    if kind == "bon":
        return float(1 - (N * u ** (N - 1) * F ** N).mean())
    if kind == "won":
        return float(1 - (N * (1 - u) ** (N - 1) * (1 - (1 - F) ** N)).mean())
    raise ValueError(f"kind={kind!r} is not 'bon' or 'won'.")


def optimal_reward(q: Tensor, N: int, kind: str = "bon") -> Tensor:
    """The transformed reward R[q] whose tilt is stationary for the T-win rate (the derivative), along the
    last dim of q."""
    u, F = grid(q.shape[-1]), cdf(q)
    g = u ** (N - 1) * F ** (N - 1) if kind == "bon" else (1 - u) ** (N - 1) * (1 - F) ** (N - 1)
    tail = (g.flip(-1).cumsum(-1).flip(-1) - g / 2) / q.shape[-1]  # ∫_w^1 g from the midpoint w (half the own cell)
    return -N ** 2 * tail


def fixed_point(beta: float | Tensor, N: int, kind: str = "bon", *, M: int = 4000, iters: int = 1500,
                alpha: float = 0.1) -> Tensor:
    """The InfAlign-optimal density at β: damped iteration q ← (1−α)q + α·softmax(R[q]/β): (M,), or (B, M)
    for a tensor of B values of β (iterated together; each row is the iteration at its own β)."""
    u = grid(M)
    beta = torch.as_tensor(beta, dtype=torch.float64)
    q = torch.ones(*beta.shape, M, dtype=torch.float64)
    beta = beta[..., None]
    for _ in range(iters):
        q = (1 - alpha) * q + alpha * density(optimal_reward(q, N, kind), beta, u)
    return q


# ---------------------------------------------------------------------------- matched-KL frontiers

def kl_and_win(qs, N: int, kind: str = "bon") -> tuple[Tensor, Tensor]:
    """(KL, T-win rate) of each density of `qs` (a list of (M,) or a (B, M) tensor): two (B,) tensors."""
    return (torch.tensor([kl_to_base(q) for q in qs], dtype=torch.float64),
            torch.tensor([win_rate(q, N, kind) for q in qs], dtype=torch.float64))


def frontier(make_q: Callable[[float], Tensor], betas: Tensor, N: int, kind: str = "bon") -> tuple[Tensor, Tensor]:
    """(KL, win rate) along a β grid for densities `make_q(β)`: two (len(betas),) tensors."""
    return kl_and_win([make_q(float(b)) for b in betas], N, kind)


def at_kl(kls: Tensor, wins: Tensor, target: float) -> float:
    """Win rate at a KL budget, interpolated along a frontier (KL increasing as β decreases)."""
    order = kls.argsort()
    k, w = kls[order].numpy(), wins[order].numpy()
    if not k[0] <= target <= k[-1]:
        raise ValueError(f"KL {target} is outside the frontier's range [{k[0]:.3g}, {k[-1]:.3g}]; widen the β grid.")
    return float(np.interp(target, k, w))


def win_at_kl(phi: Transform, N: int, kind: str, target: float, *, M: int = 4000) -> float:
    """Win rate of the Φ-tilt at a KL budget (β found by bisection on KL, which falls as β grows)."""
    u = grid(M)
    lo, hi = -12.0, 12.0  # log β
    scale = float((phi(u).max() - phi(u).min()).clamp_min(1e-12))
    for _ in range(80):
        mid = (lo + hi) / 2
        if kl_to_base(density(phi, scale * math.exp(mid), u)) > target:
            lo = mid
        else:
            hi = mid
    return win_rate(density(phi, scale * math.exp((lo + hi) / 2), u), N, kind)


TS = (1, 2, 3, 5, 7, 10, 15, 20, 30, 40)  # the t grid searched for the best exponential transform


def best_exp(N: int, kind: str, target: float, ts=TS, *, M: int = 4000, sign: str | None = None,
             control: str = "") -> tuple[float, float]:
    """The best exponential transform of sign `sign` ("bon": exp(+tu), "won": −exp(−tu); default the
    kind's own) at a KL budget, measured with the `kind` win rate: (t, win rate). A control substitutes
    the transform (`transform`)."""
    wins = [(win_at_kl(transform(sign or kind, t, control), N, kind, target, M=M), t) for t in ts]
    w, t = max(wins)
    return t, w


def setting_name(kind: str, N: int) -> str:
    """"standard" for N = 1, else "BON-4", "WON-16", ..."""
    return "standard" if N == 1 else f"{kind.upper()}-{N}"


def bon_policy_check(u: Tensor, Ns=(2, 4, 16)) -> dict[int, dict[str, float]]:
    """Log-calibrated RLHF at β = 1/(N−1) is the BoN policy: its KL and standard win rate on the grid `u`
    beside the BoN policy's known KL log N − (N−1)/N and win rate N/(N+1), per N."""
    out = {}
    for N in Ns:
        q = density(log_cal, 1 / (N - 1), u)
        out[N] = {"kl": kl_to_base(q), "kl_bon": math.log(N) - (N - 1) / N, "win": win_rate(q), "win_bon": N / (N + 1)}
    return out


def matched_kl_table(cfg: Config, control: str = "") -> dict[tuple[str, float], dict[str, float]]:
    """{(setting, KL budget): {transform: win rate}} for every setting (T, N) of `cfg.settings`: the calibrated
    identity, log, the raw N(0, 1) reward and the best exponential of each sign (`best_exp`, scored with the
    setting's own T; a control substitutes the transform), each at the budget."""
    table = {}
    for kind, N in cfg.settings:
        for k in cfg.budgets:
            row = {"identity": win_at_kl(identity, N, kind, k, M=cfg.M), "log": win_at_kl(log_cal, N, kind, k, M=cfg.M),
                   "raw": win_at_kl(raw_gaussian, N, kind, k, M=cfg.M)}
            for sign, col in (("bon", "best exp(+tu)"), ("won", "best -exp(-tu)")):
                row[col] = best_exp(N, kind, k, M=cfg.M, sign=sign, control=control)[1]
            table[setting_name(kind, N), k] = row
    return table


def optimum_frontier(N: int, kind: str, betas: Tensor, *, M: int = 2000, iters: int = 800) -> tuple[Tensor, Tensor]:
    """(KL, T-win rate) of the fixed-point optimum (`fixed_point`) along a β grid (all β iterated at once)."""
    return kl_and_win(fixed_point(betas, N, kind, M=M, iters=iters), N, kind)


def optima(cfg: Config) -> dict[tuple[str, float], float]:
    """{(setting, KL budget): the optimum's win rate} for each setting of `cfg.frontier_settings`,
    interpolated along `optimum_frontier` on the β grid `cfg.opt_betas`."""
    out = {}
    for kind, N in cfg.frontier_settings:
        betas = torch.logspace(*cfg.opt_betas, dtype=torch.float64)
        kls, wins = optimum_frontier(N, kind, betas, M=cfg.M_opt, iters=cfg.opt_iters)
        for k in cfg.budgets:
            out[setting_name(kind, N), k] = at_kl(kls, wins, k)
    return out


def tilt_frontier(phi: Transform, betas: Tensor, N: int, kind: str, u: Tensor) -> tuple[Tensor, Tensor]:
    """(KL, T-win rate) of the Φ-tilt along β given relative to Φ's range on the grid `u`."""
    span = float(phi(u).max() - phi(u).min())
    return frontier(lambda b: density(phi, span * b, u), betas, N, kind)


def frontier_curves(cfg: Config, u: Tensor) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """{setting: {transform: (KLs, win rates)}} along `cfg.curve_betas` for the identity, the raw N(0, 1)
    reward and both exponentials at t = `cfg.curve_t` (the frontier figure's data)."""
    t = cfg.curve_t
    transforms = {"identity": identity, "raw N(0,1)": raw_gaussian, f"exp({t:g}u)": exp_bon(t),
                  f"-exp(-{t:g}u)": exp_won(t)}
    betas = torch.logspace(*cfg.curve_betas, dtype=torch.float64)
    curves = {}
    for kind, N in cfg.frontier_settings:
        by = {label: tilt_frontier(phi, betas, N, kind, u) for label, phi in transforms.items()}
        curves[setting_name(kind, N)] = {label: (kls.tolist(), wins.tolist()) for label, (kls, wins) in by.items()}
    return curves


# ------------------------------------------------------------------------------------ calibration

def calibrate(base_scores: Tensor, score: Tensor) -> Tensor:
    """Ĉ = fraction of a prompt's base-policy scores below `score`, ties counted ½.

    base_scores (B, K) are K samples of π_ref per prompt, score (B, ...) the rewards to calibrate."""
    b = base_scores.reshape(base_scores.shape[0], *[1] * (score.ndim - 1), -1)  # (B, ..., K)
    s = score[..., None]
    return ((b < s).double().mean(-1) + 0.5 * (b == s).double().mean(-1))
