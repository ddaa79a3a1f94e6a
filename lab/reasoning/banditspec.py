"""BanditSpec (Hou et al., ICML 2025, arXiv 2505.15141): speculative decoding whose configuration is picked
online by a bandit. Official code: `sail-sg/BanditSpec` (greedy-only, UCB over the speculation length).

One round `SpecDecSub` (Alg. 1/6) drafts up to L tokens with the chosen arm (a drafter and its speculation
length γ), verifies them with one forward call of the target P and returns the accepted tokens plus the bonus
token, so the reward Y ∈ [1, L+1]. BanditSpec (Alg. 3) repeats rounds, the arm picked from the history only, and
its cost is the stopping time ST = number of target calls; the stopping-time regret is
E[ST(ALG)] − min_i E[ST(arm i)] (Sec. 3).

- `UCBSpec` (Alg. 4/8): play each arm once, then argmax μ̂_i + cr_i with the self-normalised radius
  cr_i = (L/2)·sqrt((1+n_i)/n_i² · (1 + 2 log(K t² sqrt(1+n_i)/δ))) (Thm 4.3, δ = 1/2), times `cr_scale`.
  `radius="repo"` is the official code's bonus sqrt(6 log t / t) (one value for every arm);
  `radius="wrong"` is a known-wrong reading, (1+n)/n instead of (1+n)/n², that never shrinks (a control).
- `EXP3Spec` (Alg. 5/9): p_t ∝ exp(−η_t Σ_s Ẑ_s), η_t = sqrt(log K/(tK)), Ẑ_i = 1{i=I_t}(L+1−Y)/(L p_i) —
  recomputed from the cumulative losses by a softmax each round (η changes every round).
- Policies are vectorised over R independent runs (state (R, K)), so the bandit-only environment (truncated
  geometric acceptance, eq. 10) simulates many runs at once, and one decoding run is R = 1.
- `gamma_load`: the γ-under-load cost model (Sec. 6.2 / Fig. 3 analog; round time g·t_draft + t_verify(b(g+1)),
  flat until saturation, then linear), reward = tokens per unit time as the official code's throughput reward;
  beside the bandits, transformers' own adaptive "heuristic" γ schedule (`heuristic_throughput`, no bandit).

The decoding loop (KV caches, drafters, greedy and rejection-sampling verification) is in
`lab.reasoning.banditspec_decode`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

POLICIES = ("UCBSpec", "EXP3Spec", "repo UCB", "uniform", "round robin")


# ------------------------------------------------------------------------------------------- config

@dataclass(frozen=True)
class Config:
    """Every size of notebook 16. Part A: bandit-only environment; B: tiny LMs; C: γ under load."""

    # A · truncated-geometric environment (Prop. 4.5)
    p: tuple[float, ...] = (0.5, 0.7, 0.85)  # per-arm acceptance parameter
    L: int = 4  # max speculation length; Y ∈ [1, L+1]
    lens: tuple[int, ...] = (500, 2000, 8000, 32000)  # output lengths |len| at which ST is read
    runs: int = 100  # independent runs per policy
    delta: float = 0.5  # δ of the radius (the theorem's value)
    cr_scale: float = 1.0  # radius scale in A (the theory radius)
    radius: str = "paper"  # "paper" | "repo" | "wrong" (control)
    bandit: str = "bandit"  # "bandit" | "round robin" | "fixed arm" (controls: every bandit replaced)
    # B · tiny target + drafters on a mixed edit / generate prompt set
    n_prompts: int = 6  # half edit, half generate
    gen_len: int = 128  # new tokens per prompt
    L_b: int = 4
    cr_scale_b: float = 0.25  # the theory radius needs hundreds of pulls; B shows 1.0 as an ablation
    target_steps: int = 160
    draft_steps: int = 150
    eagle_steps: int = 300  # EAGLE head (K = 6): at lr 1e-2 its fixed arm reaches the floor of rounds (seeds 1–4)
    eagle_lr: float = 1e-2
    rest_rows: int = 128  # REST's datastore: answers of this many training-mix sequences
    # C · γ under load
    gammas: tuple[int, ...] = (0, 1, 2, 3, 4)
    batches: tuple[int, ...] = (1, 4, 16, 64)
    n_prompts_c: int = 256  # 64 left UCBSpec ÷ best fixed γ at b=1 within 1 % of 1 on some seeds (sd 0.011)
    rounds_c: int = 1000
    t_draft: float = 0.1  # one draft step, in units of a memory-bound verify call
    n_sat: int = 16  # tokens per verify call at which it turns compute-bound
    beta_c: tuple[float, float] = (1.0, 1.0)  # per-prompt acceptance a ~ Beta (uniform)
    cr_scale_c: float = 0.1  # rewards here are ≪ L+1 at large batches: a smaller scale
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def for_scale(cls, scale: str = "smoke", control: str = "") -> Config:
        kw: dict = {}
        if scale == "full":
            kw.update(runs=200, n_prompts=64, gen_len=512, target_steps=2000, draft_steps=1000, eagle_steps=2000)
        if control in ("round_robin", "fixed_arm"):
            kw["bandit"] = control.replace("_", " ")
        return cls(**kw)


# ------------------------------------------------------------------------------------------ policies

class Policy:
    """A bandit over K arms for R parallel runs: `select() -> (R,)` arm indices, `update(arms, y)` rewards."""

    def __init__(self, K: int, R: int = 1, rng: np.random.Generator | None = None):
        self.K, self.R, self.rng = K, R, rng or np.random.default_rng(0)
        self.n = np.zeros((R, K))  # pulls n_i
        self.s = np.zeros((R, K))  # reward sums
        self.t = 0  # rounds played

    def select(self) -> np.ndarray:
        raise NotImplementedError

    def update(self, arms: np.ndarray, y: np.ndarray) -> None:
        rows = np.arange(self.R)
        self.n[rows, arms] += 1
        self.s[rows, arms] += y
        self.t += 1


class Fixed(Policy):
    def __init__(self, K: int, R: int = 1, rng=None, arm: int = 0):
        super().__init__(K, R, rng)
        self.arm = arm

    def select(self) -> np.ndarray:
        return np.full(self.R, self.arm)


class RoundRobin(Policy):
    def select(self) -> np.ndarray:
        return np.full(self.R, self.t % self.K)


class Uniform(Policy):
    def select(self) -> np.ndarray:
        return self.rng.integers(self.K, size=self.R)


def ucb_radius(n: np.ndarray, t: int, K: int, L: float, delta: float = 0.5, kind: str = "paper") -> np.ndarray:
    """cr_i of UCBSpec (Thm 4.3 / Lemma F.3) for pull counts n (…, K) after t rounds; kind "repo" is the official
    code's shared bonus sqrt(6 log t / t); "wrong" replaces (1+n)/n² by (1+n)/n (does not shrink)."""
    if kind == "repo":
        return np.full(n.shape, math.sqrt(6 * math.log(max(t, 2)) / max(t, 1)))
    log_term = 1 + 2 * np.log(K * t**2 * np.sqrt(1 + n) / delta)
    width = (1 + n) / n**2 if kind == "paper" else (1 + n) / n
    return (L / 2) * np.sqrt(width * log_term)


class UCBSpec(Policy):
    """Alg. 4: round robin over the K arms first, then argmax μ̂_i + cr_scale · cr_i (ties to the lowest index)."""

    def __init__(self, K: int, R: int = 1, rng=None, *, L: float = 4, delta: float = 0.5, cr_scale: float = 1.0,
                 radius: str = "paper"):
        super().__init__(K, R, rng)
        self.L, self.delta, self.cr_scale, self.radius = L, delta, cr_scale, radius

    def select(self) -> np.ndarray:
        if self.t < self.K:
            return np.full(self.R, self.t)
        cr = ucb_radius(self.n, self.t, self.K, self.L, self.delta, self.radius)
        return np.argmax(self.s / self.n + self.cr_scale * cr, axis=1)


class EXP3Spec(Policy):
    """Alg. 5: anytime EXP3 on the importance-weighted losses Ẑ = (L+1−Y)/(L p) (Y ∈ [1, L+1] → loss ∈ [0, 1])."""

    def __init__(self, K: int, R: int = 1, rng=None, *, L: float = 4):
        super().__init__(K, R, rng)
        self.L = L
        self.Z = np.zeros((R, K))  # Σ_s Ẑ_{i,s}
        self.probs = np.full((R, K), 1 / K)

    def select(self) -> np.ndarray:
        eta = math.sqrt(math.log(self.K) / ((self.t + 1) * self.K))
        logits = -eta * self.Z
        w = np.exp(logits - logits.max(axis=1, keepdims=True))  # log-sum-exp: 1/p weights can be huge
        self.probs = w / w.sum(axis=1, keepdims=True)
        u = self.rng.random((self.R, 1))
        return np.minimum((self.probs.cumsum(axis=1) < u).sum(axis=1), self.K - 1)

    def update(self, arms: np.ndarray, y: np.ndarray) -> None:
        rows = np.arange(self.R)
        self.Z[rows, arms] += (self.L + 1 - y) / (self.L * self.probs[rows, arms])
        super().update(arms, y)


def make_policy(name: str, K: int, R: int = 1, *, rng=None, L: float = 4, delta: float = 0.5,
                cr_scale: float = 1.0, radius: str = "paper", bandit: str = "bandit") -> Policy:
    """A policy by name: one of `POLICIES` or "fixed <i>"; the controls `bandit="round robin"` / `"fixed arm"` make
    UCBSpec and EXP3Spec round robin / always arm 0 (one configuration for every prompt)."""
    if bandit == "fixed arm" and name in ("UCBSpec", "EXP3Spec"):
        name = "fixed 0"
    if name.startswith("fixed"):
        return Fixed(K, R, rng, arm=int(name.split()[1]))
    if bandit == "round robin" and name in ("UCBSpec", "EXP3Spec"):
        name = "round robin"
    if name in ("UCBSpec", "repo UCB"):
        return UCBSpec(K, R, rng, L=L, delta=delta, cr_scale=cr_scale, radius="repo" if name == "repo UCB" else radius)
    if name == "EXP3Spec":
        return EXP3Spec(K, R, rng, L=L)
    return {"uniform": Uniform, "round robin": RoundRobin}[name](K, R, rng)


# ------------------------------------------------------------------ A · truncated-geometric environment

def tg_pmf(p: float, L: int) -> np.ndarray:
    """P(Y = x), x = 1..L+1: p^{x−1}(1−p) for x ≤ L, p^L for x = L+1 (eq. 10)."""
    x = np.arange(1, L + 2)
    return np.where(x <= L, p ** (x - 1) * (1 - p), p**L)


def tg_mean(p: float, L: int) -> float:
    """E[Y] = (1 − p^{L+1}) / (1 − p) (eq. 130)."""
    return (1 - p ** (L + 1)) / (1 - p)


def tg_sample(p: np.ndarray, L: int, rng: np.random.Generator) -> np.ndarray:
    """Y = min(Geometric(1−p), L+1), elementwise."""
    return np.minimum(rng.geometric(1 - p), L + 1)


def lower_bound_slope(p: tuple[float, ...], L: int) -> float:
    """Thm 4.4: liminf Reg/log len ≥ Σ_{i≠i*} Δ_i / (μ_{i*} KL(P_i ‖ P_{i*}))."""
    mu = [tg_mean(q, L) for q in p]
    best = int(np.argmax(mu))
    pb = tg_pmf(p[best], L)
    return float(sum((mu[best] - mu[i]) / (mu[best] * np.sum(tg_pmf(q, L) * np.log(tg_pmf(q, L) / pb)))
                     for i, q in enumerate(p) if i != best))


def stopping_times(policy: Policy, p: tuple[float, ...], L: int, lens: tuple[int, ...],
                   rng: np.random.Generator) -> np.ndarray:
    """ST (R, len(lens)): rounds until each run's output holds ≥ len tokens (policies are anytime, so one
    trajectory per run gives every len); pulls per arm stay in `policy.n`."""
    p_arr, R = np.asarray(p), policy.R
    total = np.zeros(R)
    st = np.zeros((R, len(lens)), dtype=int)
    todo = np.ones((R, len(lens)), dtype=bool)
    lens_a = np.asarray(lens)
    while todo.any():
        arms = policy.select()
        y = tg_sample(p_arr[arms], L, rng)
        policy.update(arms, y)
        total += y
        hit = todo & (total[:, None] >= lens_a[None, :])
        st[hit] = policy.t
        todo &= ~hit
    return st


def regret_curves(cfg: Config, seed: int = 0, names: tuple[str, ...] = ("UCBSpec", "EXP3Spec", "repo UCB",
                                                                         "uniform")) -> dict[str, np.ndarray]:
    """Stopping-time regret E[ST(ALG)] − E[ST(best fixed arm)] at each len, per policy (mean over `cfg.runs`);
    key "ST best" holds the best fixed arm's mean ST, "sem <name>" the standard error of each regret."""
    K, best = len(cfg.p), int(np.argmax([tg_mean(q, cfg.L) for q in cfg.p]))
    base = stopping_times(Fixed(K, cfg.runs, arm=best), cfg.p, cfg.L, cfg.lens, np.random.default_rng(10_000 + seed))
    out = {"ST best": base.mean(0)}
    for j, name in enumerate(names):
        rng = np.random.default_rng([seed, j])
        pol = make_policy(name, K, cfg.runs, rng=rng, L=cfg.L, delta=cfg.delta, cr_scale=cfg.cr_scale,
                          radius=cfg.radius, bandit=cfg.bandit)
        st = stopping_times(pol, cfg.p, cfg.L, cfg.lens, rng)
        out[name] = st.mean(0) - base.mean(0)
        out[f"sem {name}"] = np.sqrt(st.var(0, ddof=1) / cfg.runs + base.var(0, ddof=1) / cfg.runs)
    return out


# -------------------------------------------------------------------------------- C · γ under load

def round_time(g: int, b: int, cfg: Config) -> float:
    """One round for a batch of b requests drafting g tokens each: g·t_draft + t_verify(b(g+1)), t_verify(n) =
    max(1, n / n_sat) (memory-bound, then compute-bound)."""
    return g * cfg.t_draft + max(1.0, b * (g + 1) / cfg.n_sat)


def gamma_load(cfg: Config, seed: int = 0, names: tuple[str, ...] = ("UCBSpec", "EXP3Spec")) -> dict:
    """Per batch size b: throughput (tokens per unit time, per request) of each fixed γ, the per-prompt oracle γ
    (best expected throughput for the prompt's acceptance a), the best fixed γ over the prompts, and the bandits
    (reward = tokens/time of the round scaled to [0, L+1] by the round time of plain decoding)."""
    rng = np.random.default_rng(20_000 + seed)
    a = rng.beta(*cfg.beta_c, size=cfg.n_prompts_c)  # (N,) per-prompt acceptance
    G, L = np.asarray(cfg.gammas), max(cfg.gammas)
    out: dict = {"a": a, "b": list(cfg.batches)}
    for b in cfg.batches:
        time = np.array([round_time(g, b, cfg) for g in G])  # (K,)
        mean_y = np.array([[tg_mean(x, g) if g else 1.0 for g in G] for x in a])  # (N, K)
        expected = mean_y / time  # expected throughput per prompt and γ
        row = {"fixed": expected.mean(0), "oracle": expected.max(1).mean(), "oracle γ": G[expected.argmax(1)],
               "best fixed": expected.mean(0).max()}
        for j, name in enumerate(names):
            prng = np.random.default_rng([seed, b, j])
            pol = make_policy(name, len(G), cfg.n_prompts_c, rng=prng, L=L, cr_scale=cfg.cr_scale_c,
                              radius=cfg.radius, bandit=cfg.bandit)
            tok, tim = np.zeros(cfg.n_prompts_c), np.zeros(cfg.n_prompts_c)
            for _ in range(cfg.rounds_c):
                arms = pol.select()
                g = G[arms]
                y = np.where(g > 0, np.minimum(prng.geometric(1 - a), g + 1), 1)
                tok, tim = tok + y, tim + time[arms]
                pol.update(arms, y * time.min() / time[arms])  # tokens per plain-decoding time unit
            row[name] = (tok / tim).mean()
        row["heuristic"] = heuristic_throughput(a, [round_time(g, b, cfg) for g in range(L + 1)], cfg.rounds_c,
                                                np.random.default_rng([seed, b, len(names)]))
        out[b] = row
    return out


def heuristic_throughput(a: np.ndarray, time: list[float], rounds: int, rng: np.random.Generator) -> float:
    """Mean tokens per unit time of transformers' "heuristic" speculation-length schedule
    (`AssistedCandidateGenerator.update_candidate_strategy`): γ += 2 after a round whose drafts were all accepted,
    else γ = max(1, γ − 1) — per prompt of acceptance a (N,), no bandit; γ starts at and is clipped to the largest
    γ of the arms, L = len(time) − 1 (transformers starts at 20 with no cap), and never drops to 0 (no speculation)."""
    L, t = len(time) - 1, np.asarray(time)
    g = np.full(len(a), L)
    tok, tim = np.zeros(len(a)), np.zeros(len(a))
    for _ in range(rounds):
        y = np.minimum(rng.geometric(1 - a), g + 1)  # accepted drafts + the target's token
        tok, tim = tok + y, tim + t[g]
        g = np.where(y == g + 1, np.minimum(g + 2, L), np.maximum(g - 1, 1))
    return float((tok / tim).mean())
