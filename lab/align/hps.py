r"""HPS — Zou, Lin, Li & Zhou, "HPS: Hard Preference Sampling for Human Preference Alignment",
ICML 2025 (arXiv 2502.14400; code: LVLab-SMU/HPS, `dpo_iteration/run_dpo.py`).

Each prompt has n responses with annotated rewards r*. HPS prefers the best response over *all*
dispreferred ones, weighting a dispreferred response by its hardness, p_γ(y) ∝ exp(γ·r*(y)) over the
responses below the best (Robinson et al. 2020 hard negatives); a single Monte Carlo draw ỹ ~ p_γ
replaces the expectation (2 sequences per prompt instead of n for Plackett–Luce):

    code form:   −(1−ε)·log σ(β·Δh) − ε·log σ(−β·Δh)   Δh = h(y_best) − h(ỹ)
    paper form:  −log σ(β·Δh − log(n−1))                   (UNCONFIRMED: reconstructed, not in the code)

The code form is what the released `run_dpo.py` trains: `trl.DPOTrainer(loss_type="sigmoid")` on the
(best, ỹ) pair with β = 0.25 hard-coded and `label_smoothing: 0.1` from its training config (the
conservative-DPO form, ε = 0.1); it is the default here. The curriculum (`hard_i`, the config default)
keeps γ = −5 until 20 % of the data, then at the sample indices p = ⌊0.2k·N⌋ (k = 1..4) sets
γ = −5 + 10·p/(N−1): about −3, −1, +1, +3; it never reaches +5. Fixed from the official code: the
sampler subtracts the max before exp (the code's exp(γ·r) overflows once γ·r > 709), γ is initialised
before use (the code raises UnboundLocalError in its default config), and "hard" means γ > 0 (the
code's `hard` setting uses γ = −5: easy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from lab.align.exact import avoid_prob, seq_logprobs
from lab.align.train import optimize


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


def gamma_schedule(i: int, n: int, *, start: float = -5.0, end: float = 5.0) -> float:
    """The official `hard_i` curriculum: γ when training reaches sample i of n. γ = `start` until the first
    update point; at each update point p = ⌊f·n⌋, f ∈ {0.2, 0.4, 0.6, 0.8}, γ = start + (end − start)·p/(n − 1)."""
    passed = [p for p in (int(n * f) for f in (0.2, 0.4, 0.6, 0.8)) if p <= i]
    return start + (end - start) * max(passed) / (n - 1) if passed else start


def hps(pi: Tensor, ref: Tensor, *, beta: float = 0.25, r: Tensor, gamma: float = 5.0,
        generator: torch.Generator | None = None, label_smoothing: float = 0.0, normalizer: bool = False) -> Tensor:
    """HPS on (B, n) log-probs with annotated rewards `r` (B, n): the best response (by r) against one
    negative drawn from p_γ. Default: the released code's form, DPO on the pair, with its label smoothing ε
    (the official config trains ε = 0.1). `normalizer=True` is the paper form (−log(n−1) inside the sigmoid;
    UNCONFIRMED, no released code uses it; ε must be 0 then). With n = 2 and ε = 0 both reduce to DPO."""
    if normalizer and label_smoothing:
        raise ValueError("label smoothing belongs to the code form; the paper form has none (normalizer=False).")
    best = r.argmax(-1)  # (B,)
    neg = sample_negative(r, gamma, generator)  # (B,)
    h = pi - ref
    rows = torch.arange(len(h))
    z = beta * (h[rows, best] - h[rows, neg])
    if normalizer:
        z = z - math.log(h.shape[1] - 1)
    return (1 - label_smoothing) * F.softplus(-z) + label_smoothing * F.softplus(z)


# ------------------------------------------------------------------ the toy (parameter sharing matters)

@dataclass(frozen=True)
class Config:
    """Prompts with n = 1 + n_hard + n_easy candidates: the best y* (reward 1, no HARM token), hard
    negatives = y* with one token replaced by HARM (reward U[0.6, 0.9]: close to y*, and sharing its
    parameters), easy negatives = random HARM-free responses (reward U[−1, 0])."""

    n_prompts: int = 16
    V: int = 8  # response tokens; the last one is HARM
    L: int = 4
    n_hard: int = 3
    n_easy: int = 4
    d_model: int = 48
    sft_steps: int = 300
    sft_lr: float = 3e-3
    steps: int = 30
    lr: float = 3e-4  # `train`'s default, for an arm `arm_lrs` does not name
    lrs: tuple[float, ...] = (3e-4, 1e-3, 3e-3)  # each arm's learning-rate grid (`tuning_table`)
    tune_offset: int = 1000  # a tuning toy is the toy of seed + tune_offset: held out from the measured seeds 0-9
    # each arm's lr: `pick_lrs` on notebooks/results/tuning/11_hps.json (tuning toys 1000-1002, 30 steps)
    arm_lrs: tuple[tuple[str, float], ...] = (
        ("dpo max-min", 1e-3), ("dpo random", 1e-3), ("pl", 3e-3), ("hps", 3e-4), ("hps curriculum", 1e-3),
        ("hps γ=-5", 1e-3), ("hps γ=-2", 1e-3), ("hps γ=+2", 3e-4))
    beta: float = 0.25  # hard-coded in the official run_dpo.py
    label_smoothing: float = 0.1  # the official training config's ε, for every DPO-form arm (not PL)
    gamma: float = 5.0  # fixed-γ HPS
    curriculum: tuple[float, float] = (-5.0, 5.0)  # the official hard_i schedule's start and end
    gammas: tuple[float, ...] = (-5.0, -2.0, 0.0, 2.0, 5.0)  # the fixed-γ sweep
    forced_gamma: float | None = None  # a control: every HPS draw uses this γ, whatever the arm asks
    shuffled_rewards: bool = False  # a control: HPS's sampler sees each prompt's rewards permuted among its negatives

    @classmethod
    def for_scale(cls, scale: str, control: str = "") -> Config:
        """Sizes for the scale; a control (see `CONTROLS`) replaces what HPS's sampler sees, nothing else."""
        cfg = cls() if scale == "smoke" else cls(steps=90)
        if control and control not in CONTROLS:
            raise ValueError(f"unknown control {control!r}; known: {', '.join(CONTROLS)}")
        return replace(cfg, forced_gamma=-5.0 if control == "easy" else None,
                       shuffled_rewards=control == "shuffled_rewards")

    def sampler_gamma(self, gamma: float) -> float:
        """The γ HPS's sampler actually uses: the arm's, unless a control forces one."""
        return gamma if self.forced_gamma is None else self.forced_gamma


CONTROLS = {
    "easy": "γ = −5 in every HPS arm: the released code's `hard` setting, which favours easy negatives",
    "shuffled_rewards": "HPS's sampler sees each prompt's rewards permuted among its negatives, so γ no longer tracks "
                        "hardness; training, metrics and the baselines (max-min pairs, PL's ranking) keep the true "
                        "rewards",
}


def shuffle_negatives(r: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """`r` with each row's rewards below the row's max permuted among those positions (the best and its ties stay):
    (B, n) -> (B, n)."""
    out = r.clone()
    for row, neg in zip(out, r < r.max(-1, keepdim=True).values):
        idx = neg.nonzero()[:, 0]
        row[idx] = row[idx[torch.randperm(len(idx), generator=generator)]]
    return out


@dataclass
class Toy:
    reference: torch.nn.Module
    prompts: Tensor  # (C,)
    cands: Tensor  # (C, n, L): [y*, hard..., easy...]
    r: Tensor  # (C, n) annotated rewards


def make_toy(cfg: Config, seed: int, quiet: bool | None = None) -> Toy:
    """Candidates and rewards per prompt, and π_ref fit to be uniform over each prompt's candidates
    (SFT: Adam on the mean log-likelihood of the candidates)."""
    from lab.models import tiny_llama

    g = torch.Generator().manual_seed(seed)
    HARM, C = cfg.V - 1, cfg.n_prompts
    cands, rewards = [], []
    for _ in range(C):
        best = torch.randint(HARM, (cfg.L,), generator=g)
        hard = best.repeat(cfg.n_hard, 1)
        hard[torch.arange(cfg.n_hard), torch.randperm(cfg.L, generator=g)[: cfg.n_hard]] = HARM
        easy = torch.randint(HARM, (cfg.n_easy, cfg.L), generator=g)
        cands.append(torch.cat([best[None], hard, easy]))
        rewards.append(torch.cat([torch.ones(1), 0.6 + 0.3 * torch.rand(cfg.n_hard, generator=g),
                                  -torch.rand(cfg.n_easy, generator=g)]))
    cands, r = torch.stack(cands), torch.stack(rewards)
    prompts = torch.arange(cfg.V, cfg.V + C)
    torch.manual_seed(seed)
    model = tiny_llama(vocab_size=cfg.V + C, d_model=cfg.d_model, n_layers=2, n_heads=4, max_len=cfg.L + 1)
    optimize(model.parameters(), lambda _: -seq_logprobs(model, prompts, cands, cfg.V).mean(), steps=cfg.sft_steps,
             lr=cfg.sft_lr, desc="SFT", quiet=quiet)
    return Toy(model.eval(), prompts, cands, r)


METHODS = ("dpo max-min", "dpo random", "pl", "hps", "hps curriculum")


@torch.no_grad()
def candidate_logprobs(model: torch.nn.Module, toy: Toy, cfg: Config) -> Tensor:
    """log π(y | x) of every prompt's candidates, exactly (no gradient): (C, n)."""
    return seq_logprobs(model, toy.prompts, toy.cands, cfg.V)


def train(method: str, toy: Toy, cfg: Config, seed: int, quiet: bool | None = None, *,
          gamma: float | None = None, lr: float | None = None) -> torch.nn.Module:
    """Preference-train a copy of π_ref on every prompt per step with one method: DPO on (best, lowest-reward)
    or (best, random) pairs, listwise Plackett–Luce over all candidates ranked by reward, HPS with fixed γ
    (`gamma`, default `cfg.gamma`), or HPS with the official curriculum (step i of the run is sample i of N).
    The DPO-form arms use the official label smoothing `cfg.label_smoothing`; PL has none. Adam at `lr`
    (default `cfg.lr`). Under `cfg.shuffled_rewards` HPS's sampler sees the rewards permuted among each
    prompt's negatives (a permutation drawn once per run from seed + 1, so the sampler's own draws are kept)."""
    import copy

    from lab.align.losses import dpo, plackett_luce

    policy = copy.deepcopy(toy.reference).train()
    ref = candidate_logprobs(toy.reference, toy, cfg)  # (C, n)
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(len(ref))
    order = toy.r.argsort(-1, descending=True)  # ranking for PL
    eps = cfg.label_smoothing
    seen = shuffle_negatives(toy.r, torch.Generator().manual_seed(seed + 1)) if cfg.shuffled_rewards else toy.r

    def step_loss(step: int) -> Tensor:
        pi = seq_logprobs(policy, toy.prompts, toy.cands, cfg.V)
        if method == "pl":
            loss = plackett_luce(pi.gather(1, order), ref.gather(1, order), beta=cfg.beta)
        elif method.startswith("hps"):
            γ = (gamma_schedule(step, cfg.steps, start=cfg.curriculum[0], end=cfg.curriculum[1])
                 if method == "hps curriculum" else cfg.gamma if gamma is None else gamma)
            loss = hps(pi, ref, beta=cfg.beta, r=seen, gamma=cfg.sampler_gamma(γ), generator=g, label_smoothing=eps)
        else:
            neg = toy.r.argmin(-1) if method == "dpo max-min" else sample_negative(toy.r, 0.0, g)
            loss = dpo(torch.stack([pi[:, 0], pi[rows, neg]], 1), torch.stack([ref[:, 0], ref[rows, neg]], 1),
                       beta=cfg.beta, label_smoothing=eps)
        return loss.mean()

    optimize(policy.parameters(), step_loss, steps=cfg.steps, lr=cfg.lr if lr is None else lr, desc=method,
             quiet=quiet)
    return policy.eval()


def arms(cfg: Config) -> dict[str, tuple[str, float | None]]:
    """Every trained arm, name -> (method, γ): the methods, and fixed-γ HPS at each γ of the sweep that is not
    already an arm (γ = `cfg.gamma` is "hps"; γ = 0 draws a uniform negative, i.e. is "dpo random")."""
    extra = {f"hps γ={γ:+g}": ("hps", γ) for γ in cfg.gammas if γ not in (0.0, cfg.gamma)}
    return {m: (m, None) for m in METHODS} | extra


def sweep_arm(cfg: Config, gamma: float) -> str:
    """The arm that trains fixed-γ HPS at `gamma`."""
    return "hps" if gamma == cfg.gamma else "dpo random" if gamma == 0 else f"hps γ={gamma:+g}"


def tune(toy: Toy, cfg: Config, seed: int, quiet: bool | None = None) -> dict[str, dict[float, dict[str, float]]]:
    """Every arm trained at every learning rate of `cfg.lrs` on one toy: arm -> lr -> metrics."""
    return {name: {lr: metrics(train(m, toy, cfg, seed, quiet, gamma=γ, lr=lr), toy, cfg) for lr in cfg.lrs}
            for name, (m, γ) in arms(cfg).items()}


def tuning_table(cfg: Config, seeds: tuple[int, ...] = (0, 1, 2), quiet: bool | None = None
                 ) -> dict[str, dict[str, dict[str, float]]]:
    """`tune` on the tuning toys `seed + cfg.tune_offset` (held out from the measured toys), each metric averaged
    over them: arm -> str(lr) -> mean metrics (the table behind `cfg.arm_lrs`)."""
    runs = [tune(make_toy(cfg, s + cfg.tune_offset, quiet), cfg, s, quiet) for s in seeds]
    return {name: {str(lr): {k: sum(t[name][lr][k] for t in runs) / len(runs) for k in runs[0][name][lr]}
                   for lr in cfg.lrs} for name in runs[0]}


def pick_lrs(table: dict[str, dict[str, dict[str, float]]], n: int) -> dict[str, float]:
    """The one rule every arm's learning rate follows: the largest mean margin over the hardest negative (what the
    claims compare) among the learning rates that keep a mean mass ≥ 1/n on the best response (π_ref's share; a
    larger lr moves the DPO-form arms' mass off every candidate); if none does, the largest such mass."""
    def pick(by_lr: dict[str, dict[str, float]]) -> float:
        ok = [lr for lr, m in by_lr.items() if m["p_best"] >= 1 / n]
        best = max(ok, key=lambda lr: by_lr[lr]["margin"]) if ok else max(by_lr, key=lambda lr: by_lr[lr]["p_best"])
        return float(best)
    return {name: pick(by_lr) for name, by_lr in table.items()}


def load_tuning() -> dict:
    """The recorded learning-rate table behind `Config.arm_lrs` (notebooks/results/tuning/11_hps.json): its tuning
    seeds, the mean metrics per arm and lr (`tuning_table`) and the lrs `pick_lrs` takes from it."""
    import json

    from lab.core.results import path_of

    return json.loads(path_of("tuning/11_hps").read_text())


def run_arms(toy: Toy, cfg: Config, seed: int, quiet: bool | None = None
             ) -> tuple[dict[str, torch.nn.Module], dict[str, dict[str, float]]]:
    """Every arm trained at its learning rate (`cfg.arm_lrs`): (arm -> policy, arm -> metrics)."""
    lrs = dict(cfg.arm_lrs)
    policies = {name: train(m, toy, cfg, seed, quiet, gamma=γ, lr=lrs.get(name)) for name, (m, γ) in arms(cfg).items()}
    return policies, {name: metrics(p, toy, cfg) for name, p in policies.items()}


@torch.no_grad()
def metrics(policy: torch.nn.Module, toy: Toy, cfg: Config) -> dict[str, float]:
    """margin = log π(y*) − max over hard negatives log π (mean over prompts); mass on y*, on the
    hard and on the easy negatives; harm = exact probability that a sampled response contains HARM."""
    logp = candidate_logprobs(policy, toy, cfg)  # (C, n)
    hard = slice(1, 1 + cfg.n_hard)
    harm = 1 - avoid_prob(policy, toy.prompts, cfg.V, cfg.L, cfg.V - 1)  # (C,)
    return {"margin": float((logp[:, 0] - logp[:, hard].max(-1).values).mean()),
            "p_best": float(logp[:, 0].exp().mean()),
            "p_hard": float(logp[:, hard].exp().sum(-1).mean()),
            "p_easy": float(logp[:, 1 + cfg.n_hard:].exp().sum(-1).mean()),
            "harm": float(harm.mean())}
