r"""EXPO — Hu, Kong, He & Wipf, "Explicit Preference Optimization: No Need for an Implicit Reward
Model", ICML 2025 (arXiv 2506.07492; code: lmkong020/explicit-preference-optimization).

DPO-like losses see π_θ only through h_θ = log π_θ − log π_ref; their population minimizer is
π_ref·π*^{1/λ}/Z (BT preferences with strength π*), which moves a prompt where π_ref is already
optimal (*preservation* failure) and collapses to argmax π* as λ → 0 (*interpolation* failure).
EXPO instead posits the two desiderata explicitly (the `expo` branch of the official `Model.forward`):

    ℓ_EXPO = E[−log σ(log π_θ(y_w|x) − log π_θ(y_l|x))]  +  λ·E_x[KL(π_ref(·|x) ‖ π_θ(·|x))]

The first term is the BT likelihood with the *policy's own* log-probs (minimizer: π*), the second a
mass-covering regularizer (minimizer: π_ref). The official code computes the KL with
`F.kl_div(log π_θ, log π_ref, log_target=True)` and the default `reduction="mean"`, which divides
by the number of responses: `kl_scale="mean"` mirrors that (effective weight λ/|Y|), "sum" does not.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lab.align.exact import all_sequences, fit_exact, seq_logprobs
from lab.align.train import optimize

METHODS = ("dpo", "ipo", "fdpo_js", "rlhf", "expo")  # the §5 comparison; λ is β for the DPO family
CONTROLS = {"dpo": "EXPO replaced by DPO (β = λ) in the same solves and trainings (same data, λ, lr and steps)"}


@dataclass(frozen=True)
class Config:
    """The §5 toys (official notebooks): interpolation with π* = [.6, .3, .1], π_ref = [.4, .4, .2];
    preservation with a good context (π_ref = π* = [.6, .3, .1]) and a bad one (π* = [.6, .2, .2],
    π_ref = [.4, .2, .4])."""

    interp_log_lams: tuple[float, ...] = (-5, -3, -2, -1, 0, 1, 2, 3, 5)
    preserve_log_lams: tuple[float, ...] = (-3, -2, -1, 0, 1, 2, 3)
    n_pairs: int = 300  # sampled variant: uniform draws before dropping ties (official: 300)
    epochs: int = 300  # sampled variant (official: 1000)
    sampled_lam: float = 1e-5  # the vanishing λ of the sampled variant
    lr_dpo: float = 1e-3
    lr_expo: float = 5e-4
    # tiny transformer: every response of length L over V tokens is enumerated (V^L per prompt)
    V: int = 6
    L: int = 3
    d_model: int = 32
    sft_steps: int = 300
    lm_lams: tuple[float, ...] = (0.1, 1.0, 10.0)
    lm_steps: int = 200
    lm_batch: int = 128  # pairs per prompt per step
    lm_lr: float = 2e-3
    bad_kl: float = 1.0  # KL(π*_bad ‖ π_ref,bad) of the tilted target
    expo_loss: str = "expo"  # the loss trained wherever the notebook runs EXPO (a control substitutes it)

    @classmethod
    def for_scale(cls, scale: str, control: str = "") -> Config:
        """Sizes for the scale; a control (see `CONTROLS`) replaces EXPO's loss, nothing else."""
        if control and control not in CONTROLS:
            raise ValueError(f"unknown control {control!r}; known: {', '.join(CONTROLS)}")
        grid = tuple(x / 2 for x in range(-10, 11))
        sizes = {} if scale == "smoke" else dict(interp_log_lams=grid, preserve_log_lams=grid, epochs=1000,
                                                   lm_lams=(0.03, 0.1, 0.3, 1.0, 3.0, 10.0), lm_steps=400)
        return cls(**sizes, **({"expo_loss": control} if control else {}))  # each control names the loss it trains

    def grids(self) -> dict[str, tuple[float, ...]]:
        """{context: its log λ grid}: the interpolation grid and the preservation grid twice."""
        return {"interpolation": self.interp_log_lams, "good": self.preserve_log_lams, "bad": self.preserve_log_lams}

    def loss(self, method: str) -> str:
        """The loss actually trained for `method`: EXPO's substitute under a control, else the method itself."""
        return self.expo_loss if method == "expo" else method

    @staticmethod
    def settings() -> dict[str, tuple[Tensor, Tensor]]:
        """{context: (π_ref, π*)} in float64."""
        t = lambda *p: torch.tensor(p, dtype=torch.float64)
        return {"interpolation": (t(0.4, 0.4, 0.2), t(0.6, 0.3, 0.1)),
                "good": (t(0.6, 0.3, 0.1), t(0.6, 0.3, 0.1)), "bad": (t(0.4, 0.2, 0.4), t(0.6, 0.2, 0.2))}


def expo(pi: Tensor, ref: Tensor, *, lam: float = 1.0, kl: Tensor) -> Tensor:
    """Per-example EXPO loss on (B, 2) log-probs: −log σ(π_w − π_l) + λ·kl, with `kl` (B,) an
    estimate of KL(π_ref(·|x) ‖ π_θ(·|x)) for each example's prompt (`kl_exact`, or a token-level
    or reference-sample estimate at LM scale). `ref` is unused by the supervised term, by design."""
    if pi.ndim != 2 or pi.shape[1] != 2:
        raise ValueError(f"EXPO is pairwise: pi must be (B, 2); got {tuple(pi.shape)}.")
    return F.softplus(-(pi[:, 0] - pi[:, 1])) + lam * kl


def kl_exact(logp_ref: Tensor, logp: Tensor, *, scale: str = "sum") -> Tensor:
    """KL(π_ref ‖ π_θ) over a full response set: (..., Y) log-probs -> (...). `scale="mean"`
    divides by |Y| as the official `F.kl_div(reduction="mean")` does."""
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
    return kl / logp.shape[-1] if scale == "mean" else kl


# ------------------------------------------------------------------ the exact tabular setting (§5)

def pair_table(pi_ref: Tensor, pi_star: Tensor, *, pairs: str = "uniform") -> tuple[Tensor, Tensor, Tensor]:
    """All ordered pairs (i, j), i ≠ j, of K responses with their population weight: the two
    responses drawn uniformly (the official toy notebooks: `random` pairs, ties dropped) or from π_ref
    (`pairs="reference"`), and y_i ≻ y_j with BT probability σ(log π*_i − log π*_j).
    Returns (i, j) index tensors (P,) and weights (P,) summing to 1."""
    K = pi_ref.shape[-1]
    i, j = torch.meshgrid(torch.arange(K), torch.arange(K), indexing="ij")
    keep = i != j
    i, j = i[keep], j[keep]
    draw = pi_ref[i] * pi_ref[j] if pairs == "reference" else torch.ones(len(i), dtype=pi_ref.dtype)
    w = draw * torch.sigmoid(pi_star[i].log() - pi_star[j].log())
    return i, j, w / w.sum()


def population_loss(method: str, logits: Tensor, pi_ref: Tensor, pi_star: Tensor, lam: float, *,
                    kl_scale: str = "mean", pairs: str = "uniform") -> Tensor:
    """The expected loss of `method` for one prompt with K responses (tabular policy softmax(logits)).

    Methods: the registry's pairwise losses ("dpo", "ipo", "fdpo_js") with β = λ as in the official
    code, "expo", and "rlhf" (exact KL-regularised RL with reward log π*)."""
    from lab.align import LOSSES

    logp, logp_ref = logits.log_softmax(-1), pi_ref.log()
    if method == "rlhf":
        return -(logp.exp() * (pi_star.log() - lam * (logp - logp_ref))).sum()
    i, j, w = pair_table(pi_ref, pi_star, pairs=pairs)
    pi, ref = torch.stack([logp[i], logp[j]], 1), torch.stack([logp_ref[i], logp_ref[j]], 1)  # (P, 2)
    if method == "expo":
        per_pair = expo(pi, ref, lam=lam, kl=kl_exact(logp_ref, logp, scale=kl_scale).expand(len(i)))
    else:
        per_pair = LOSSES[method](pi, ref, beta=lam)
    return (w * per_pair).sum()


def solve(method: str, pi_ref: Tensor, pi_star: Tensor, lam: float, *, kl_scale: str = "mean",
          pairs: str = "uniform", iters: int = 200) -> Tensor:
    """The policy minimizing the population loss (float64 L-BFGS from π_ref's logits): (K,).

    "rlhf" returns its known optimum π_ref·π*^{1/λ}/Z: its objective is flat near a point mass
    (gradients ∝ π(1−π)), so L-BFGS stalls there at small λ."""
    pi_ref, pi_star = pi_ref.double(), pi_star.double()
    if method == "rlhf":
        return dpo_minimizer(pi_ref, pi_star, lam)
    logits = pi_ref.log().clone().requires_grad_()
    opt = torch.optim.LBFGS([logits], lr=1.0, max_iter=iters, tolerance_grad=1e-12, tolerance_change=1e-14,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = population_loss(method, logits, pi_ref, pi_star, lam, kl_scale=kl_scale, pairs=pairs)
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    return logits.detach().softmax(-1)


def dpo_minimizer(pi_ref: Tensor, pi_star: Tensor, lam: float) -> Tensor:
    """Closed form of DPO's (and RLHF's) population minimizer: π_ref · π*^{1/λ} / Z."""
    logp = pi_ref.log() + pi_star.log() / lam
    return logp.softmax(-1)


def kl_divergence(p: Tensor, q: Tensor) -> float:
    """KL(p ‖ q) between two distributions over the same K responses, sum reduction (the distance of
    the official tables, e.g. KL(π* ‖ π_θ))."""
    return float((p * (p.log() - q.log())).sum())


# ------------------------------------------------------------ the sampled variant (official toy)

def sample_pairs(pi_star: Tensor, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """The official `generate_data`: n uniform draws of two responses, ties dropped, the winner by
    BT(π*). Returns y_w, y_l (P,) with P ≈ n·(1 − 1/K)."""
    K = len(pi_star)
    a, b = torch.randint(K, (n,), generator=generator), torch.randint(K, (n,), generator=generator)
    keep = a != b
    a, b = a[keep], b[keep]
    a_wins = torch.rand(len(a), generator=generator, dtype=pi_star.dtype) < pi_star[a] / (pi_star[a] + pi_star[b])
    return torch.where(a_wins, a, b), torch.where(a_wins, b, a)


def train_tabular(method: str, y_w: Tensor, y_l: Tensor, pi_ref: Tensor, lam: float, *, epochs: int,
                  lr: float, batch_size: int = 20, record_every: int = 50,
                  quiet: bool | None = None) -> tuple[Tensor, Tensor]:
    """Adam on a tabular policy from π_ref's logits over the pairs, in order, `epochs` times, as the
    official `train` (grad-norm clip 10). Returns the final policy (K,) and its trajectory (S, K):
    the policy after every `record_every` steps."""
    from lab.align import LOSSES

    logits = pi_ref.log().clone().requires_grad_()
    logp_ref = pi_ref.log()
    starts = range(0, len(y_w), batch_size)
    traj = []

    def step_loss(step: int) -> Tensor:
        if step and step % record_every == 0:  # the policy after `step` updates
            traj.append(logits.detach().softmax(-1))
        s = starts[step % len(starts)]
        w, l = y_w[s:s + batch_size], y_l[s:s + batch_size]
        logp = logits.log_softmax(-1)
        pi, ref = torch.stack([logp[w], logp[l]], 1), torch.stack([logp_ref[w], logp_ref[l]], 1)
        if method == "expo":
            return expo(pi, ref, lam=lam, kl=kl_exact(logp_ref, logp, scale="mean").expand(len(w))).mean()
        return LOSSES[method](pi, ref, beta=lam).mean()

    steps = epochs * len(starts)
    optimize([logits], step_loss, steps=steps, lr=lr, grad_clip=10.0, desc=f"tabular {method}", quiet=quiet)
    if steps % record_every == 0:
        traj.append(logits.detach().softmax(-1))
    return logits.detach().softmax(-1), torch.stack(traj)


def sampled_runs(cfg: Config, pi_ref: Tensor, pi_star: Tensor, seed: int,
                 methods: tuple[str, ...] = ("dpo", "expo")) -> tuple[dict[str, tuple[Tensor, Tensor]], int]:
    """The official sampled experiment: `cfg.n_pairs` uniform pairs labelled by BT(π*) (generator seeded
    with `seed`), then each method's tabular policy trained on them at λ = `cfg.sampled_lam` (DPO at
    `cfg.lr_dpo`, every other loss at `cfg.lr_expo`). Returns {method: (final π_θ, trajectory)} and the
    number of pairs kept."""
    y_w, y_l = sample_pairs(pi_star, cfg.n_pairs, torch.Generator().manual_seed(seed))
    return {m: train_tabular(cfg.loss(m), y_w, y_l, pi_ref, cfg.sampled_lam, epochs=cfg.epochs,
                             lr=cfg.lr_dpo if m == "dpo" else cfg.lr_expo) for m in methods}, len(y_w)


def sweep(method: str, pi_ref: Tensor, pi_star: Tensor, log_lams) -> Tensor:
    """Population solutions over a log λ grid: (L, K)."""
    return torch.stack([solve(method, pi_ref, pi_star, math.exp(ll)) for ll in log_lams])


def population_solutions(cfg: Config) -> dict[str, dict[str, Tensor]]:
    """{context: {method: (L, K) population solutions over the context's log λ grid}} for the three §5
    contexts and every method of `METHODS` (EXPO's loss substituted under a control)."""
    settings = Config.settings()
    return {ctx: {m: sweep(cfg.loss(m), *settings[ctx], lams) for m in METHODS} for ctx, lams in cfg.grids().items()}


def closed_form_gap(solutions: Tensor, pi_ref: Tensor, pi_star: Tensor, log_lams) -> float:
    """max |Δπ| between population solutions (L, K) and DPO's closed form π_ref·π*^{1/λ}/Z over the grid."""
    closed = torch.stack([dpo_minimizer(pi_ref, pi_star, math.exp(ll)) for ll in log_lams])
    return (solutions - closed).abs().max().item()


def monotonicity(log_lams, distances: Tensor) -> Tensor:
    """Spearman rank correlation between log λ and a distance (L,) (ranks by sort order, no tie
    averaging): 1 when the distance grows strictly with λ. What claim C2 reads on EXPO's KL(π*‖π_θ)."""
    lams = torch.tensor(log_lams, dtype=torch.float64)
    rank = [x.argsort().argsort().double() for x in (lams, distances)]
    return torch.corrcoef(torch.stack(rank))[0, 1]


def preservation_kl(method: str, log_lams, pi: Tensor | None = None) -> Tensor:
    """What claim C1 measures: KL(π* ‖ π_θ) (L,) of `method`'s population solution at each log λ on a context
    whose reference is already optimal, π_ref = π* = `pi` (default the §5 *good* context [.6, .3, .1]).
    0 means the context is preserved; C1 reads the max over λ for EXPO and the min over log λ ≤ 0 for DPO."""
    pi = Config.settings()["good"][1] if pi is None else pi.double()
    solutions = sweep(method, pi, pi, log_lams)
    return (pi * (pi.log() - solutions.log())).sum(-1)


# ------------------------------------------- the same tests on a tiny transformer (exact enumeration)

def tilt(logp: Tensor, target_kl: float, generator: torch.Generator) -> Tensor:
    """A random log-linear tilt of a distribution, π ∝ exp(logp + τ·z), with τ set by bisection so
    that KL(π ‖ exp(logp)) = target_kl: the toy's π* for the *bad* prompt."""
    z = torch.randn(logp.shape, generator=generator, dtype=logp.dtype)
    lo, hi = 0.0, 50.0
    for _ in range(60):
        tau = (lo + hi) / 2
        q = (logp + tau * z).log_softmax(-1)
        lo, hi = (tau, hi) if (q.exp() * (q - logp)).sum() < target_kl else (lo, tau)
    return (logp + tau * z).log_softmax(-1)


def train_lm(method: str, policy, prompts: Tensor, seqs: Tensor, ref_logp: Tensor, star_logp: Tensor, lam: float, *,
             V: int, steps: int, lr: float, batch: int, generator: torch.Generator,
             quiet: bool | None = None) -> Tensor:
    """Preference training of a tiny LM: each step draws `batch` pairs per prompt from π_ref with soft
    BT labels from π* (the expected loss over labels), applies the method's pairwise loss, and for
    EXPO adds λ·KL(π_ref ‖ π_θ) computed exactly over all responses. Returns log π_θ (C, S)."""
    from lab.align import LOSSES

    C = len(prompts)

    def step_loss(_: int) -> Tensor:
        logp = seq_logprobs(policy, prompts, seqs, V)  # (C, S)
        i = torch.multinomial(ref_logp.exp(), batch, replacement=True, generator=generator)  # (C, batch)
        j = torch.multinomial(ref_logp.exp(), batch, replacement=True, generator=generator)
        p_ij = torch.sigmoid(star_logp.gather(1, i) - star_logp.gather(1, j)).flatten()  # P(y_i ≻ y_j)
        a, b = logp.gather(1, i).flatten(), logp.gather(1, j).flatten()
        ra, rb = ref_logp.gather(1, i).flatten(), ref_logp.gather(1, j).flatten()
        fwd, bwd = torch.stack([a, b], 1), torch.stack([b, a], 1)
        rfwd, rbwd = torch.stack([ra, rb], 1), torch.stack([rb, ra], 1)
        if method == "expo":
            kl_ = kl_exact(ref_logp, logp).repeat_interleave(batch)  # (C·batch,)
            loss = p_ij * expo(fwd, rfwd, lam=lam, kl=kl_) + (1 - p_ij) * expo(bwd, rbwd, lam=lam, kl=kl_)
        else:
            f = LOSSES[method]
            loss = p_ij * f(fwd, rfwd, beta=lam) + (1 - p_ij) * f(bwd, rbwd, beta=lam)
        return loss.sum() / C / batch

    optimize(policy.parameters(), step_loss, steps=steps, lr=lr, desc=f"LM {method}", quiet=quiet)
    with torch.no_grad():
        return seq_logprobs(policy, prompts, seqs, V)


@dataclass
class LMToy:
    """The tiny-transformer preservation/interpolation setting: prompt 0 is *good* (π* = π_ref),
    prompt 1 *bad* (π* a tilt of π_ref with KL(π*‖π_ref) = cfg.bad_kl)."""

    reference: torch.nn.Module
    prompts: Tensor  # (2,) prompt token ids
    seqs: Tensor  # (S, L) every response
    ref_logp: Tensor  # (2, S) log π_ref
    star_logp: Tensor  # (2, S) log π*
    sft_kl: float  # KL(SFT target ‖ π_ref) reached by the exact SFT


def lm_toy(cfg: Config, seed: int) -> LMToy:
    """Build π_ref by exact SFT of a tiny Llama onto random targets, then π* for both prompts."""
    from lab.models import tiny_llama

    seqs, prompts = all_sequences(cfg.V, cfg.L), torch.tensor([cfg.V, cfg.V + 1])
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = tiny_llama(vocab_size=cfg.V + 2, d_model=cfg.d_model, n_layers=2, n_heads=2, d_ff=2 * cfg.d_model,
                       max_len=cfg.L + 1)
    target = torch.randn(2, len(seqs), generator=g).log_softmax(-1)
    kls = fit_exact(model, prompts, seqs, target, cfg.V, steps=cfg.sft_steps, lr=3e-3)
    with torch.no_grad():
        ref = seq_logprobs(model, prompts, seqs, cfg.V)
    star = torch.stack([ref[0], tilt(ref[1].double(), cfg.bad_kl, g).float()])
    return LMToy(model.eval(), prompts, seqs, ref, star, kls[-1])


def lm_sweep(toy: LMToy, cfg: Config, seed: int,
             methods: tuple[str, ...] = ("dpo", "expo")) -> dict[tuple[str, float], Tensor]:
    """Train a copy of the toy's π_ref with each method at each λ of `cfg.lm_lams` (`train_lm`; pairs drawn
    from a generator seeded with seed + 1, the same for every run). Returns {(method, λ): KL(π* ‖ π_θ) on the
    (good, bad) prompts (2,)}."""
    out = {}
    for method in methods:
        for lam in cfg.lm_lams:
            logp = train_lm(cfg.loss(method), copy.deepcopy(toy.reference), toy.prompts, toy.seqs, toy.ref_logp,
                            toy.star_logp, lam, V=cfg.V, steps=cfg.lm_steps, lr=cfg.lm_lr, batch=cfg.lm_batch,
                            generator=torch.Generator().manual_seed(seed + 1))
            out[method, lam] = (toy.star_logp.exp() * (toy.star_logp - logp)).sum(-1)
    return out
