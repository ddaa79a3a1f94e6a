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

Where calibration has work to do: prompts whose raw rewards have different scales, analytically
(`heterogeneous`) and on a tiny transformer scored by exact enumeration (`lm_toy`, `lm_compare`), where CTRL's
Ĉ from K base samples per prompt (`calibrate`, `calibration_sweep`) is set beside the exact C. The module is
over the lab's ~300 lines because it holds both the analytical tool and the enumerated tiny transformer.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

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
    # tiny transformer by exact enumeration: V^L responses, prompts with heterogeneous reward scales
    V: int = 6
    L: int = 3
    sigmas: tuple[float, ...] = (1.0, 0.3, 0.1, 3.0)  # per-prompt reward scale
    sft_steps: int = 300
    rl_steps: int = 250
    lr: float = 3e-3
    lm_kl: float = 0.5
    lm_N: int = 4
    lm_ts: tuple[float, ...] = (5.0, 10.0)  # CTRL's exp(t·u) on the tiny transformer
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
    "raw": "CTRL's per-prompt calibration replaced by the raw reward, min-max scaled to [0, 1] over all prompts "
           "(standard RLHF's reward, brought into the transforms' range)",
}


def check_control(control: str) -> str:
    if control and control not in CONTROLS:
        raise ValueError(f"unknown control {control!r}; known: {', '.join(CONTROLS)}")
    return control


def transform(kind: str, t: float, control: str = "") -> Transform:
    """CTRL's transform: exp(t·u) for BoN (`kind="bon"`), −exp(−t·u) for WoN; the identity under the
    `identity` control."""
    if check_control(control) == "identity":
        return identity
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

def frontier(make_q: Callable[[float], Tensor], betas: Tensor, N: int, kind: str = "bon") -> tuple[Tensor, Tensor]:
    """(KL, win rate) along a β grid for densities `make_q(β)`: two (len(betas),) tensors."""
    qs = [make_q(float(b)) for b in betas]
    return (torch.tensor([kl_to_base(q) for q in qs], dtype=torch.float64),
            torch.tensor([win_rate(q, N, kind) for q in qs], dtype=torch.float64))


def at_kl(kls: Tensor, wins: Tensor, target: float) -> float:
    """Win rate at a KL budget, interpolated along a frontier (KL increasing as β decreases)."""
    order = kls.argsort()
    k, w = kls[order].numpy(), wins[order].numpy()
    if not k[0] <= target <= k[-1]:
        raise ValueError(f"KL {target} is outside the frontier's range [{k[0]:.3g}, {k[-1]:.3g}]; widen the β grid.")
    import numpy as np

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
    qs = fixed_point(betas, N, kind, M=M, iters=iters)
    return (torch.tensor([kl_to_base(q) for q in qs], dtype=torch.float64),
            torch.tensor([win_rate(q, N, kind) for q in qs], dtype=torch.float64))


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


def shared_beta(R: Tensor, u: Tensor, target: float) -> float:
    """One β for all prompts (rows of R, (P, M)) with mean KL(q_β ‖ U[0, 1]) = target (bisection on log β)."""
    lo, hi = -15.0, 15.0
    for _ in range(80):
        mid = (lo + hi) / 2
        q = density(R, math.exp(mid), u)
        lo, hi = (mid, hi) if float((q * q.clamp_min(1e-300).log()).mean(-1).mean()) > target else (lo, mid)
    return math.exp((lo + hi) / 2)


def heterogeneous(cfg: Config, control: str = "") -> dict[str, dict[str, float | list[float]]]:
    """The analytical tool with several prompts whose raw rewards have different scales: under π_ref prompt i's
    reward is σ_i·z, z ~ N(0, 1), i.e. r_i(u) = σ_i·Φ_N^{-1}(u) at its calibrated reward u. Raw RLHF tilts by r_i,
    CTRL by the calibrated u (the same for every prompt) or by exp(t·u) rescaled to [0, 1]; one β, shared by the
    prompts, matches the mean KL `cfg.lm_kl` (a derivation for this lab, not the paper's text). Under the `raw`
    control the calibration is the raw reward min-max scaled over all prompts, under `identity` the transform is
    the identity. Returns {reward: {"beta", "kl" (per prompt), "std", "bon" (BoN-`cfg.lm_N`, mean over prompts)}}."""
    u = grid(cfg.M)
    r = torch.tensor(cfg.het_sigmas, dtype=torch.float64)[:, None] * raw_gaussian(u)  # (P, M)
    cal = (r - r.min()) / (r.max() - r.min()) if check_control(control) == "raw" else u.expand_as(r)
    rewards = {"raw RLHF": r, "CTRL identity": cal,
               f"CTRL exp({cfg.het_t:g}u)": rescaled(transform("bon", cfg.het_t, control))(cal)}
    out = {}
    for name, R in rewards.items():
        beta = shared_beta(R, u, cfg.lm_kl)
        qs = density(R, beta, u)
        out[name] = {"beta": beta, "kl": [kl_to_base(q) for q in qs],
                     "std": sum(win_rate(q) for q in qs) / len(qs),
                     "bon": sum(win_rate(q, cfg.lm_N, "bon") for q in qs) / len(qs)}
    return out


# ------------------------------------------------------------------------------------ calibration

def calibrate(base_scores: Tensor, score: Tensor) -> Tensor:
    """Ĉ = fraction of a prompt's base-policy scores below `score`, ties counted ½.

    base_scores (B, K) are K samples of π_ref per prompt, score (B, ...) the rewards to calibrate."""
    b = base_scores.reshape(base_scores.shape[0], *[1] * (score.ndim - 1), -1)  # (B, ..., K)
    s = score[..., None]
    return ((b < s).double().mean(-1) + 0.5 * (b == s).double().mean(-1))


# ------------------------------------------ the tiny transformer, by exact enumeration (claim I5)

def calibrate_exact(ref_logp: Tensor, r: Tensor) -> Tensor:
    """C(x, y) = P_{y'~π_ref(·|x)}(r(y') < r(y)) + ½P(=), exact over the enumerated responses: (C, S)."""
    p = ref_logp.double().exp()  # (C, S)
    less = (r[:, None, :] < r[:, :, None]).double()  # (C, S_y, S_y')
    equal = (r[:, None, :] == r[:, :, None]).double()
    return ((less + 0.5 * equal) * p[:, None, :]).sum(-1)


def calibration(ref_logp: Tensor, r: Tensor, control: str = "") -> Tensor:
    """CTRL's calibrated reward (C, S): the exact per-prompt quantile `calibrate_exact`; under the `raw`
    control the raw reward min-max scaled over all prompts (a global affine map: no per-prompt quantile)."""
    if check_control(control) == "raw":
        return (r - r.min()) / (r.max() - r.min())
    return calibrate_exact(ref_logp, r)


def rescaled(phi: Transform) -> Transform:
    """Φ mapped onto [0, 1] over u ∈ [0, 1] (β then lives on a sane scale for every t)."""
    lo, hi = phi(torch.tensor(0.0, dtype=torch.float64)), phi(torch.tensor(1.0, dtype=torch.float64))
    return lambda u: (phi(u) - lo) / (hi - lo)


def lm_logprobs(model, prompts: Tensor, V: int, L: int) -> Tensor:
    """log π(y | x) for every prompt token x (C,) and every response y of `lab.align.exact.all_sequences(V, L)`:
    (C, V^L), equal to `lab.align.exact.seq_logprobs` (same next-token softmax over the V response tokens) but
    from one forward over the V^(L−1) prefixes: the last position's distribution scores all V final tokens
    (the prefix trick of `lab.align.exact.avoid_prob`; about 3× faster here)."""
    from lab.align.exact import all_sequences

    prefixes = all_sequences(V, L - 1) if L > 1 else torch.zeros(1, 0, dtype=torch.long)  # (S', L−1)
    C, S = len(prompts), len(prefixes)
    x = torch.cat([prompts[:, None, None].expand(C, S, 1), prefixes.expand(C, S, L - 1)], -1).reshape(C * S, L)
    logp = model(input_ids=x).logits[..., :V].log_softmax(-1)  # (C·S', L, V): position t predicts token t+1
    prefix = logp[:, :-1].gather(-1, x[:, 1:, None])[..., 0].sum(-1)  # log π(prefix | x)
    return (prefix[:, None] + logp[:, -1]).reshape(C, S * V)  # lexicographic order: the last token runs fastest


def lm_fit(model, prompts: Tensor, target_logp: Tensor, cfg: Config, quiet: bool | None = None) -> list[float]:
    """Exact SFT (`lab.align.exact.fit_exact`'s objective, KL(target ‖ π_θ) averaged over prompts, with Adam)
    on `lm_logprobs`; returns the KL before each step."""
    from lab.align.train import optimize

    p = target_logp.exp()

    def step_loss(_: int) -> Tensor:
        return (p * (target_logp - lm_logprobs(model, prompts, cfg.V, cfg.L))).sum(-1).mean()

    return optimize(model.parameters(), step_loss, steps=cfg.sft_steps, lr=cfg.lr, desc="exact SFT", quiet=quiet)


def lm_rlhf(policy, prompts: Tensor, ref_logp: Tensor, R: Tensor, beta: float, cfg: Config,
            quiet: bool | None = None) -> Tensor:
    """The exact KL-regularized objective Σ_y π_θ(y)[R(y) − β(log π_θ(y) − log π_ref(y))], averaged over prompts,
    maximized with Adam (`lab.align.exact.train_rlhf`'s objective on `lm_logprobs`). Returns log π_θ (C, S)."""
    from lab.align.train import optimize

    def step_loss(_: int) -> Tensor:
        logp = lm_logprobs(policy, prompts, cfg.V, cfg.L)
        return -(logp.exp() * (R - beta * (logp - ref_logp))).sum(-1).mean()

    optimize(policy.parameters(), step_loss, steps=cfg.rl_steps, lr=cfg.lr, desc="exact RLHF", quiet=quiet)
    with torch.no_grad():
        return lm_logprobs(policy, prompts, cfg.V, cfg.L)


@dataclass
class LMToy:
    reference: torch.nn.Module
    prompts: Tensor  # (C,)
    seqs: Tensor  # (S, L)
    ref_logp: Tensor  # (C, S)
    r: Tensor  # (C, S) raw reward: per-prompt scale × a linear token-position score


def lm_toy(cfg: Config, seed: int) -> LMToy:
    """π_ref by exact SFT of a tiny Llama onto random per-prompt targets; a linear reward whose
    scale differs by prompt (so one β over- or under-optimizes raw rewards per prompt)."""
    from lab.align.exact import all_sequences
    from lab.models import tiny_llama

    C = len(cfg.sigmas)
    seqs, prompts = all_sequences(cfg.V, cfg.L), torch.arange(cfg.V, cfg.V + C)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = tiny_llama(vocab_size=cfg.V + C, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=cfg.L + 1)
    lm_fit(model, prompts, torch.randn(C, len(seqs), generator=g).log_softmax(-1), cfg)
    with torch.no_grad():
        ref = lm_logprobs(model, prompts, cfg.V, cfg.L)
    W = torch.randn(cfg.V, cfg.L, generator=g)  # score of token v at position t
    r = torch.tensor(cfg.sigmas)[:, None] * W[seqs, torch.arange(cfg.L)].sum(-1)[None, :]
    return LMToy(model.eval(), prompts, seqs, ref, r.double())


def lm_rewards(toy: LMToy, cfg: Config, control: str = "") -> dict[str, Tensor]:
    """The rewards compared on the tiny transformer (C, S): raw RLHF's, CTRL's calibrated identity and
    CTRL's exp(t·u) for each t of `cfg.lm_ts`, rescaled to [0, 1] (a control substitutes calibration or transform)."""
    cal = calibration(toy.ref_logp, toy.r, control)  # exact per-prompt quantile
    return {"raw RLHF": toy.r, "CTRL identity": cal} | {f"CTRL exp({t:g}u)": rescaled(transform("bon", t, control))(cal)
                                                        for t in cfg.lm_ts}


def lm_metrics(logp: Tensor, toy: LMToy, N: int) -> dict[str, float]:
    """Mean over prompts of KL(π ‖ π_ref), the exact BoN-N win rate and the standard win rate against π_ref."""
    from lab.align.exact import win_rate as exact_win_rate

    return {"kl": float((logp.exp() * (logp - toy.ref_logp.double())).sum(-1).mean()),
            "bon": float(exact_win_rate(logp, toy.ref_logp, toy.r, N).mean()),
            "std": float(exact_win_rate(logp, toy.ref_logp, toy.r, 1).mean())}


def lm_compare(toy: LMToy, cfg: Config, control: str = "",
               quiet: bool | None = None) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, float]]:
    """For each reward of `lm_rewards`: one β shared by the prompts with mean KL `cfg.lm_kl` on the closed form
    π_ref·e^{R/β}, then a copy of π_ref trained on the exact KL-regularized objective at that β. Returns
    {reward: {"closed" | "trained": `lm_metrics`}} and {reward: β}."""
    from lab.align.exact import beta_for_kl, tilt_logp

    lm, betas = {}, {}
    for name, R in lm_rewards(toy, cfg, control).items():
        betas[name] = beta = beta_for_kl(toy.ref_logp, R, cfg.lm_kl)
        closed = tilt_logp(toy.ref_logp, R, beta)
        trained = lm_rlhf(copy.deepcopy(toy.reference), toy.prompts, toy.ref_logp, R.float(), beta, cfg, quiet).double()
        lm[name] = {"closed": lm_metrics(closed, toy, cfg.lm_N), "trained": lm_metrics(trained, toy, cfg.lm_N)}
    return lm, betas


def sampled_calibration(toy: LMToy, K: int, generator: torch.Generator) -> Tensor:
    """CTRL's Ĉ as the algorithm computes it (`calibrate`): each prompt's rewards ranked among K responses
    drawn from π_ref for that prompt (C, S)."""
    idx = torch.multinomial(toy.ref_logp.double().exp(), K, replacement=True, generator=generator)  # (C, K)
    return calibrate(toy.r.gather(1, idx), toy.r)


def calibration_sweep(toy: LMToy, cfg: Config, seed: int, control: str = "") -> dict[str, dict[str, float]]:
    """The sampled calibration Ĉ (K base samples per prompt, `sampled_calibration`) against the exact C, for
    each K of `cfg.cal_Ks` ("K=…") and for C itself ("exact"), averaged over `cfg.cal_draws` draws:
    "err" = E_{y~π_ref}|Ĉ(y) − C(y)| (mean over prompts); CTRL exp(t·u) (t the largest of `cfg.lm_ts`, rescaled)
    at matched KL `cfg.lm_kl` on the closed form π_ref·e^{R/β}: its BoN-N win rate "bon" (against π_ref, with the
    true reward) and its mass "sat" on the saturated responses, those ranked above all K samples (Ĉ = 1, where
    the reward stops increasing), beside their π_ref mass "sat_ref"; CTRL identity on the same Ĉ: its BoN-N win
    rate "bon_identity" and standard win rate "std". A control substitutes the calibration (`raw`: the global
    min-max map, no sample is used) or the transform (`lab.align.infalign.CONTROLS`)."""
    from lab.align.exact import beta_for_kl, tilt_logp

    exact, ref_p = calibration(toy.ref_logp, toy.r, control), toy.ref_logp.double().exp()
    phi = rescaled(transform("bon", max(cfg.lm_ts), control))
    g = torch.Generator().manual_seed(seed)

    def measure(cal: Tensor) -> dict[str, float]:
        R = phi(cal)
        logp = tilt_logp(toy.ref_logp, R, beta_for_kl(toy.ref_logp, R, cfg.lm_kl))
        ident = lm_metrics(tilt_logp(toy.ref_logp, cal, beta_for_kl(toy.ref_logp, cal, cfg.lm_kl)), toy, cfg.lm_N)
        top = (cal == 1).double()
        return {"err": float((ref_p * (cal - exact).abs()).sum(-1).mean()),
                "bon": lm_metrics(logp, toy, cfg.lm_N)["bon"], "sat": float((logp.exp() * top).sum(-1).mean()),
                "sat_ref": float((ref_p * top).sum(-1).mean()),
                "bon_identity": ident["bon"], "std": ident["std"]}

    out = {}
    for K in cfg.cal_Ks:
        draws = [measure(exact)] if control == "raw" else [measure(sampled_calibration(toy, K, g))
                                                           for _ in range(cfg.cal_draws)]
        out[f"K={K}"] = {k: sum(d[k] for d in draws) / len(draws) for k in draws[0]}
    out["exact"] = measure(exact)
    return out
