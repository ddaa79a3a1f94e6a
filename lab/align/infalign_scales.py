r"""InfAlign where calibration has work to do: prompts whose raw rewards have different scales (claims I2, I5,
I6), the companion of `lab.align.infalign` (Balashankar, Sun et al., ICML 2025, arXiv 2412.19792).

On one prompt the calibrated identity is the N = 1 optimum by construction (R(w) = w − 1), so calibration is
put to work on several prompts whose raw rewards have different scales under one shared β: a raw reward spends
the KL budget on the large-scale prompts, CTRL's per-prompt quantile gives every prompt the same tilt. Measured two
ways: the analytical tool over several prompts (`heterogeneous`), and a tiny transformer whose V^L responses are
scored by exact enumeration (`lm_toy`, `lm_compare`), where CTRL's Ĉ from K base samples per prompt
(`infalign.calibrate`, `calibration_sweep`) is set beside the exact C. Beside raw RLHF stand two baselines tuned
like CTRL: the per-prompt z-scored reward (r − E_ref r)/sd_ref r (GRPO-style normalization) and exp(t·z) on it, t
picked per seed on the metric. Sizes come from `infalign.Config`; the controls are `infalign.CONTROLS`. Kept apart
from the paper module so that each reads in one sitting.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lab.align import exact as X
from lab.align.infalign import (
    Config,
    Transform,
    calibrate,
    check_control,
    density,
    grid,
    kl_to_base,
    raw_gaussian,
    transform,
    win_rate,
)


def rescaled(phi: Transform) -> Transform:
    """Φ mapped onto [0, 1] over u ∈ [0, 1] (β then lives on a sane scale for every t)."""
    lo, hi = phi(torch.tensor(0.0, dtype=torch.float64)), phi(torch.tensor(1.0, dtype=torch.float64))
    return lambda u: (phi(u) - lo) / (hi - lo)


def zscore(ref_logp: Tensor, r: Tensor) -> Tensor:
    """The per-prompt z-scored reward (r − E_ref r) / sd_ref r under π_ref (rows: prompts; GRPO-style): a per-prompt
    affine map, so it removes scale and shift but not the shape of each prompt's reward distribution."""
    p = ref_logp.double().exp()
    mu = (p * r).sum(-1, keepdim=True)
    return (r - mu) / (p * (r - mu) ** 2).sum(-1, keepdim=True).sqrt()


def exp_z(z: Tensor, t: float) -> Tensor:
    """The baseline exp(t·z) on a z-scored reward, divided by its largest value over all prompts (a constant factor,
    absorbed by β; it keeps exp(t·z) finite)."""
    return torch.exp(t * (z - z.max()))


def calibrate_global(ref_logp: Tensor, r: Tensor) -> Tensor:
    """The `global_calibration` control's C: each reward's quantile under π_ref pooled over the prompts (the uniform
    mixture of the rows of π_ref), ties ½: one CDF for every prompt, so the prompts' scales come back (C, S)."""
    pool, order = r.reshape(-1).sort()
    w = (ref_logp.double().exp() / len(r)).reshape(-1)[order]
    cw = torch.cat([w.new_zeros(1), w.cumsum(0)])  # pooled mass below each sorted position
    lo, hi = torch.searchsorted(pool, r.contiguous()), torch.searchsorted(pool, r.contiguous(), right=True)
    return cw[lo] + 0.5 * (cw[hi] - cw[lo])


def calibration(ref_logp: Tensor, r: Tensor, control: str = "") -> Tensor:
    """CTRL's calibrated reward (C, S): the exact per-prompt quantile `lab.align.exact.calibrate_exact`; under the
    `global_calibration` control the quantile against π_ref pooled over the prompts (`calibrate_global`)."""
    if check_control(control) == "global_calibration":
        return calibrate_global(ref_logp, r)
    return X.calibrate_exact(ref_logp, r)


def best_t(ref_logp: Tensor, z: Tensor, r: Tensor, cfg: Config) -> float:
    """The baseline's t: the t of `cfg.z_ts` whose exp(t·z) has the best BoN-`cfg.lm_N` win rate (true reward r)
    on the closed form π_ref·e^{R/β} at mean KL `cfg.lm_kl`, β shared by the prompts (tuned on the metric, like
    CTRL's t on the analytical tool)."""
    def bon(t: float) -> float:
        R = exp_z(z, t)
        logp = X.tilt_logp(ref_logp, R, X.beta_for_kl(ref_logp, R, cfg.lm_kl))
        return float(X.win_rate(logp, ref_logp, r, cfg.lm_N).mean())

    return max(cfg.z_ts, key=bon)


BASELINES = {"std": ("raw RLHF", "z-scored"), "bon": ("raw RLHF", "z-scored", "z-scored exp(tz)")}


def best_baseline(by: dict[str, dict[str, float]], metric: str) -> float:
    """The strongest baseline's value of `metric` among `by`'s rewards ({reward: {metric: value}}): raw RLHF and
    z-scored for the standard win rate ("std"), and for BoN ("bon") exp(t·z) too (its t is tuned for BoN)."""
    return max(by[m][metric] for m in BASELINES[metric])


# ------------------------------------------------------------- the analytical tool over several prompts (I2)

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
    the baselines by the per-prompt z-scored reward (`zscore`) or exp(t·z) (`exp_z`, t of `cfg.z_ts` with the best
    BoN-`cfg.lm_N` win rate), CTRL by the calibrated u (the same for every prompt) or by exp(t·u) rescaled to [0, 1];
    one β, shared by the prompts, matches the mean KL `cfg.lm_kl` (a derivation for this lab, not the paper's text).
    A control substitutes CTRL's calibration or transform (`infalign.CONTROLS`). Returns {reward: {"beta", "kl" (per
    prompt), "std", "bon" (BoN-`cfg.lm_N`, mean over prompts)}}, and "t" for exp(t·z)."""
    u = grid(cfg.M)
    r = torch.tensor(cfg.het_sigmas, dtype=torch.float64)[:, None] * raw_gaussian(u)  # (P, M)
    ref = torch.full_like(r, -math.log(cfg.M))  # π_ref: uniform over the grid's cells
    cal = calibrate_global(ref, r) if check_control(control) == "global_calibration" else u.expand_as(r)
    z = zscore(ref, r)

    def measure(R: Tensor) -> dict[str, float | list[float]]:
        beta = shared_beta(R, u, cfg.lm_kl)
        qs = density(R, beta, u)
        return {"beta": beta, "kl": [kl_to_base(q) for q in qs], "std": sum(win_rate(q) for q in qs) / len(qs),
                "bon": sum(win_rate(q, cfg.lm_N, "bon") for q in qs) / len(qs)}

    by_t = {t: measure(exp_z(z, t)) for t in cfg.z_ts}
    t = max(by_t, key=lambda k: by_t[k]["bon"])
    return {"raw RLHF": measure(r), "z-scored": measure(z), "z-scored exp(tz)": by_t[t] | {"t": t},
            "CTRL identity": measure(cal),
            f"CTRL exp({cfg.het_t:g}u)": measure(rescaled(transform("bon", cfg.het_t, control))(cal))}


# ------------------------------------------ the tiny transformer, by exact enumeration (I5, I6)

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
    from lab.models import tiny_llama

    C = len(cfg.sigmas)
    seqs, prompts = X.all_sequences(cfg.V, cfg.L), torch.arange(cfg.V, cfg.V + C)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = tiny_llama(vocab_size=cfg.V + C, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=cfg.L + 1)
    X.fit_all(model, prompts, torch.randn(C, len(seqs), generator=g).log_softmax(-1), cfg.V, cfg.L, steps=cfg.sft_steps,
            lr=cfg.lr)
    with torch.no_grad():
        ref = X.all_logprobs(model, prompts, cfg.V, cfg.L)
    W = torch.randn(cfg.V, cfg.L, generator=g)  # score of token v at position t
    r = torch.tensor(cfg.sigmas)[:, None] * W[seqs, torch.arange(cfg.L)].sum(-1)[None, :]
    return LMToy(model.eval(), prompts, seqs, ref, r.double())


def lm_rewards(toy: LMToy, cfg: Config, control: str = "", t_z: float | None = None) -> dict[str, Tensor]:
    """The rewards compared on the tiny transformer (C, S): raw RLHF's; the baselines, the per-prompt z-scored reward
    and exp(t·z) on it (t = `t_z`, by default `best_t`); CTRL's calibrated identity and CTRL's exp(t·u) for each t
    of `cfg.lm_ts`, rescaled to [0, 1] (a control substitutes CTRL's calibration or transform, nothing else)."""
    z = zscore(toy.ref_logp, toy.r)
    t_z = best_t(toy.ref_logp, z, toy.r, cfg) if t_z is None else t_z
    cal = calibration(toy.ref_logp, toy.r, control)  # exact per-prompt quantile
    ctrl = {f"CTRL exp({t:g}u)": rescaled(transform("bon", t, control))(cal) for t in cfg.lm_ts}
    return {"raw RLHF": toy.r, "z-scored": z, "z-scored exp(tz)": exp_z(z, t_z), "CTRL identity": cal} | ctrl


def lm_metrics(logp: Tensor, toy: LMToy, N: int) -> dict[str, float]:
    """Mean over prompts of KL(π ‖ π_ref), the exact BoN-N win rate and the standard win rate against π_ref."""
    return {"kl": float((logp.exp() * (logp - toy.ref_logp.double())).sum(-1).mean()),
            "bon": float(X.win_rate(logp, toy.ref_logp, toy.r, N).mean()),
            "std": float(X.win_rate(logp, toy.ref_logp, toy.r, 1).mean())}


def lm_compare(toy: LMToy, cfg: Config, control: str = "",
               quiet: bool | None = None) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, float]]:
    """For each reward of `lm_rewards`: one β shared by the prompts with mean KL `cfg.lm_kl` on the closed form
    π_ref·e^{R/β}, then a copy of π_ref trained on the exact KL-regularized objective at that β
    (`lab.align.exact.train_rlhf_all`). Returns {reward: {"closed" | "trained": `lm_metrics`}} (and "t", the
    baseline's t, for exp(t·z)) and {reward: β}."""
    lm, betas = {}, {}
    t_z = best_t(toy.ref_logp, zscore(toy.ref_logp, toy.r), toy.r, cfg)
    for name, R in lm_rewards(toy, cfg, control, t_z).items():
        betas[name] = beta = X.beta_for_kl(toy.ref_logp, R, cfg.lm_kl)
        closed = X.tilt_logp(toy.ref_logp, R, beta)
        trained = X.train_rlhf_all(copy.deepcopy(toy.reference), toy.prompts, toy.ref_logp, R.float(), beta, cfg.V,
                                   cfg.L, steps=cfg.rl_steps, lr=cfg.lr, quiet=quiet).double()
        lm[name] = {"closed": lm_metrics(closed, toy, cfg.lm_N), "trained": lm_metrics(trained, toy, cfg.lm_N)}
    lm["z-scored exp(tz)"]["t"] = t_z
    return lm, betas


def sampled_calibration(toy: LMToy, K: int, generator: torch.Generator, control: str = "") -> Tensor:
    """CTRL's Ĉ as the algorithm computes it (`calibrate`): each prompt's rewards ranked among K responses
    drawn from π_ref for that prompt (C, S); under `global_calibration` among the C·K draws of all prompts pooled."""
    idx = torch.multinomial(toy.ref_logp.double().exp(), K, replacement=True, generator=generator)  # (C, K)
    base = toy.r.gather(1, idx)
    if check_control(control) == "global_calibration":
        base = base.reshape(1, -1).expand(len(base), -1)  # (C, C·K): every prompt ranked against the pool
    return calibrate(base, toy.r)


def calibration_sweep(toy: LMToy, cfg: Config, seed: int, control: str = "") -> dict[str, dict[str, float]]:
    """The sampled calibration Ĉ (K base samples per prompt, `sampled_calibration`) against the exact C, for
    each K of `cfg.cal_Ks` ("K=…") and for C itself ("exact"), averaged over `cfg.cal_draws` draws:
    "err" = E_{y~π_ref}|Ĉ(y) − C(y)| (mean over prompts); CTRL exp(t·u) (t the largest of `cfg.lm_ts`, rescaled)
    at matched KL `cfg.lm_kl` on the closed form π_ref·e^{R/β}: its BoN-N win rate "bon" (against π_ref, with the
    true reward) and its mass "sat" on the saturated responses, those ranked above all K samples (Ĉ = 1, where
    the reward stops increasing), beside their π_ref mass "sat_ref"; CTRL identity on the same Ĉ: its BoN-N win
    rate "bon_identity" and standard win rate "std". A control substitutes the calibration (`global_calibration`: the
    exact C and Ĉ against π_ref pooled over the prompts) or the transform (`lab.align.infalign.CONTROLS`)."""
    exact, ref_p = calibration(toy.ref_logp, toy.r, control), toy.ref_logp.double().exp()
    phi = rescaled(transform("bon", max(cfg.lm_ts), control))
    g = torch.Generator().manual_seed(seed)

    def measure(cal: Tensor) -> dict[str, float]:
        R = phi(cal)
        logp = X.tilt_logp(toy.ref_logp, R, X.beta_for_kl(toy.ref_logp, R, cfg.lm_kl))
        ident = lm_metrics(X.tilt_logp(toy.ref_logp, cal, X.beta_for_kl(toy.ref_logp, cal, cfg.lm_kl)), toy, cfg.lm_N)
        top = (cal == 1).double()
        return {"err": float((ref_p * (cal - exact).abs()).sum(-1).mean()),
                "bon": lm_metrics(logp, toy, cfg.lm_N)["bon"], "sat": float((logp.exp() * top).sum(-1).mean()),
                "sat_ref": float((ref_p * top).sum(-1).mean()),
                "bon_identity": ident["bon"], "std": ident["std"]}

    out = {}
    for K in cfg.cal_Ks:
        draws = [measure(sampled_calibration(toy, K, g, control)) for _ in range(cfg.cal_draws)]
        out[f"K={K}"] = {k: sum(d[k] for d in draws) / len(draws) for k in draws[0]}
    out["exact"] = measure(exact)
    return out
