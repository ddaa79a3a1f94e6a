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
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from lab.align.exact import all_sequences, seq_logprobs
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
    lr: float = 3e-4
    beta: float = 0.25
    gamma: float = 5.0  # fixed-γ HPS
    curriculum: tuple[float, float] = (-5.0, 5.0)  # the official hard_i schedule, first and last chunk

    @classmethod
    def for_scale(cls, scale: str, control: str = "") -> Config:
        """Sizes for the scale; a control (see `CONTROLS`) replaces HPS's sampler, nothing else."""
        cfg = cls() if scale == "smoke" else cls(steps=90)
        if control and control not in CONTROLS:
            raise ValueError(f"unknown control {control!r}; known: {', '.join(CONTROLS)}")
        γ = {"uniform": 0.0, "easy": -5.0}.get(control)
        return cfg if γ is None else replace(cfg, gamma=γ, curriculum=(γ, γ))


CONTROLS = {
    "uniform": "HPS's negatives drawn uniformly (γ = 0, fixed and in the curriculum): DPO with a random negative",
    "easy": "γ = −5 for HPS and its curriculum: the released code's `hard` setting, which favours easy negatives",
}


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


def train(method: str, toy: Toy, cfg: Config, seed: int, quiet: bool | None = None) -> torch.nn.Module:
    """Preference-train a copy of π_ref on every prompt per step with one method:
    DPO on (best, lowest-reward) or (best, random) pairs, listwise Plackett–Luce over all candidates
    ranked by reward, HPS with fixed γ, or HPS with the official −5 → 5 curriculum (5 chunks)."""
    import copy

    from lab.align.losses import dpo, plackett_luce

    policy = copy.deepcopy(toy.reference).train()
    ref = candidate_logprobs(toy.reference, toy, cfg)  # (C, n)
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(len(ref))
    order = toy.r.argsort(-1, descending=True)  # ranking for PL

    def step_loss(step: int) -> Tensor:
        pi = seq_logprobs(policy, toy.prompts, toy.cands, cfg.V)
        if method == "pl":
            loss = plackett_luce(pi.gather(1, order), ref.gather(1, order), beta=cfg.beta)
        elif method.startswith("hps"):
            gamma = (gamma_schedule(step * 5 // cfg.steps, start=cfg.curriculum[0], end=cfg.curriculum[1])
                     if method == "hps curriculum" else cfg.gamma)
            loss = hps(pi, ref, beta=cfg.beta, r=toy.r, gamma=gamma, generator=g, normalizer=False)
        else:
            neg = toy.r.argmin(-1) if method == "dpo max-min" else sample_negative(toy.r, 0.0, g)
            loss = dpo(torch.stack([pi[:, 0], pi[rows, neg]], 1), torch.stack([ref[:, 0], ref[rows, neg]], 1),
                       beta=cfg.beta)
        return loss.mean()

    optimize(policy.parameters(), step_loss, steps=cfg.steps, lr=cfg.lr, desc=method, quiet=quiet)
    return policy.eval()


@torch.no_grad()
def metrics(policy: torch.nn.Module, toy: Toy, cfg: Config) -> dict[str, float]:
    """margin = log π(y*) − max over hard negatives log π (mean over prompts); mass on y*, on the
    hard and on the easy negatives; harm = exact probability that a sampled response contains HARM."""
    logp = candidate_logprobs(policy, toy, cfg)  # (C, n)
    hard = slice(1, 1 + cfg.n_hard)
    everything = all_sequences(cfg.V, cfg.L)  # (V^L, L)
    has_harm = (everything == cfg.V - 1).any(-1)
    full = seq_logprobs(policy, toy.prompts, everything, cfg.V).exp()  # (C, V^L)
    return {"margin": float((logp[:, 0] - logp[:, hard].max(-1).values).mean()),
            "p_best": float(logp[:, 0].exp().mean()),
            "p_hard": float(logp[:, hard].exp().sum(-1).mean()),
            "p_easy": float(logp[:, 1 + cfg.n_hard:].exp().sum(-1).mean()),
            "harm": float(full[:, has_harm].sum(-1).mean())}
