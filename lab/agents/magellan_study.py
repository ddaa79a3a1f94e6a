"""MAGELLAN's study: the baseline goal samplers, a training run of the simulated learner under any sampler, and
the goal-space swap (Gaven et al., ICML 2025, arXiv 2502.07709; official code `LorisGaven/MAGELLAN`).

Baselines as in `magellan/goal_sampler.py`: uniform (`RandomGoalSampler`, `magellan.Sampler`), Online-ALP — a FIFO
of the last 100 outcomes per goal, ALP = |mean(newer half) − mean(older half)|, 0 with fewer than 2 outcomes, the
same ε-greedy ∝ ALP over goals (`OnlineGoalSampler`) — and EK-Online-ALP — the same over expert buckets {grasp,
plant, herbivore, carnivore}, the ε-branch uniform over 5 buckets incl. the impossible one, the LP branch ∝ ALP over
the 4 feasible buckets, then a uniform goal inside (`EKOnlineGoalSampler`); plus an oracle driven by the learner's
true ALP per goal on MAGELLAN's R, N schedule.

The evaluation-based estimators of the paper's Q1 (Sec. 4, not in the official code): Eval-ALP evaluates every goal
with dedicated episodes, EK-Eval-ALP a sample of goals per expert bucket; both cost evaluation episodes that train
nothing, which is why the paper uses them to score competence estimation, not to drive training. Here they are run
beside MAGELLAN on its own learner at each of its recomputes (`Run.q1`), so the three estimate the same competences.

The goal-space swap (the paper's Q4; `main.py` with `adaptation_test`): after the main run, every goal is replaced
by a held-out-object goal (`little_zoo.make_goal_space(split="test")`) and training goes on. MAGELLAN keeps its
weights and empties D (`magellan.Magellan.swap`; the official run reloads D, which holds the old goals' texts, not
emulated here); Online-ALP's per-goal buffers carry over as the official `load` restores them, by index within each
family (`OnlineALP.swap`); EK-Online-ALP keeps its bucket buffers (the same families; the official `load` restores
them too).
"""

from __future__ import annotations

import copy
from collections import deque

import numpy as np
from torch import Tensor

from lab.agents.little_zoo import FAMILIES, IMPOSSIBLE, GoalSpace, Student
from lab.agents.magellan import Config, Magellan, Sampler, eps_greedy, epsilon
from lab.core.stages import stage

SAMPLERS = ("random", "online_alp", "ek_online_alp", "magellan", "oracle")
Q1 = ("rounds", "magellan", "eval_alp", "ek_eval_alp")  # the competence estimators of the paper's Q1


def half_alp(outcomes) -> float:
    """Online-ALP of one FIFO: |mean(newer half) − mean(older half)|, 0 with fewer than 2 outcomes."""
    n = len(outcomes)
    if n < 2:
        return 0.0
    o = np.asarray(outcomes, dtype=float)
    return float(abs(o[n // 2:].mean() - o[: n // 2].mean()))


class OnlineALP(Sampler):
    """Online-ALP: a FIFO of the last `fifo` outcomes per goal; ALP per goal; ε-greedy ∝ ALP over goals."""

    def __init__(self, space, cfg):
        super().__init__(space, cfg)
        self.fifos: dict[int, deque] = {}
        self.alp, self.estimate = np.zeros(self.G), np.full(self.G, np.nan)

    def probs(self, t):
        return eps_greedy(self.alp, epsilon(t, self.cfg))

    def update(self, t, goals, outcomes):
        for g, r in zip(goals, outcomes):
            q = self.fifos.setdefault(int(g), deque(maxlen=self.cfg.fifo))
            q.append(r)
            self.alp[g], self.estimate[g] = half_alp(q), np.mean(q)

    def swap(self, space):
        """As the official adaptation test does: its `load` restores the per-goal buffers and ALPs by index, and its
        goal lists are ordered by family, so the k-th new goal of a family inherits the k-th old goal's buffer (a new
        family member with no old counterpart starts empty)."""
        old_family, old_fifos = self.space.family, self.fifos
        super().swap(space)
        self.fifos, self.alp, self.estimate = {}, np.zeros(self.G), np.full(self.G, np.nan)
        for f in range(len(FAMILIES)):
            for a, b in zip(np.flatnonzero(old_family == f), np.flatnonzero(space.family == f)):
                if int(a) in old_fifos:
                    q = self.fifos[int(b)] = deque(old_fifos[int(a)], maxlen=self.cfg.fifo)
                    self.alp[b], self.estimate[b] = half_alp(q), np.mean(q)


class EKOnlineALP(Sampler):
    """EK-Online-ALP: expert buckets = the families; bucket FIFO + ALP; ε → uniform over the 5 buckets, else a
    feasible bucket ∝ ALP; then a uniform goal inside the bucket."""

    def __init__(self, space, cfg):
        super().__init__(space, cfg)
        self.fifos = [deque(maxlen=cfg.fifo) for _ in FAMILIES]
        self.swap(space)

    def probs(self, t):
        alp = np.array([half_alp(q) for q in self.fifos[:IMPOSSIBLE]] + [0.0])
        eps = epsilon(t, self.cfg)
        bucket = np.full(len(FAMILIES), 1 / len(FAMILIES)) if alp.sum() <= 0 else \
            eps / len(FAMILIES) + (1 - eps) * alp / alp.sum()
        return bucket[self.space.family] / self.sizes[self.space.family]

    def update(self, t, goals, outcomes):
        for g, r in zip(goals, outcomes):
            self.fifos[self.space.family[g]].append(r)

    def swap(self, space):
        super().swap(space)
        self.sizes = np.bincount(space.family, minlength=len(FAMILIES))


class Oracle(Sampler):
    """The true-ALP oracle: |C_t(g) − C_{t−N}(g)| per goal from the learner's exact competence, MAGELLAN's schedule."""

    def __init__(self, space, cfg, student: Student):
        super().__init__(space, cfg)
        self.student, self.history = student, deque([student.state()], maxlen=cfg.N + 1)
        self.alp = np.zeros(self.G)

    def probs(self, t):
        return eps_greedy(self.alp, epsilon(t, self.cfg))

    def update(self, t, goals, outcomes):
        self.history.append(self.student.state())
        if (t + 1) % self.cfg.R == 0:
            now, then = self.student.competence(self.space), self.student.competence(self.space, self.history[0])
            self.alp = np.abs(now - then)
            self.alp[self.alp < self.cfg.threshold] = 0.0


def eval_alp(true: np.ndarray, m: int, rng) -> np.ndarray:
    """Eval-ALP's competence estimate: m evaluation episodes of every goal, each a success with the goal's current
    competence `true` (as in `Student.attempt`, without the practice); the success rate per goal. Costs m·G episodes."""
    return rng.binomial(m, true) / m


def ek_eval_alp(true: np.ndarray, family: np.ndarray, n: int, rng) -> np.ndarray:
    """EK-Eval-ALP's estimate: n evaluation episodes per expert bucket (the families, the impossible one included),
    on goals drawn uniformly inside it; every goal gets its bucket's success rate. Costs n·5 episodes."""
    est = np.empty(len(true))
    for f in range(len(FAMILIES)):
        idx = np.flatnonzero(family == f)
        if len(idx):
            est[idx] = rng.binomial(1, true[rng.choice(idx, n)]).mean()
    return est


def mae_by_family(est: np.ndarray, true: np.ndarray, family: np.ndarray) -> np.ndarray:
    """Mean |est − true| over each family's goals, then over every feasible goal: (6,) in FAMILIES + ("feasible",)."""
    err = np.abs(est - true)
    masks = [family == f for f in range(len(FAMILIES))] + [family != IMPOSSIBLE]
    return np.array([err[m].mean() if m.any() else np.nan for m in masks])


# ------------------------------------------------------------------------ a run

class Run:
    """A fresh `Student` trained with goals from sampler `name`; `step()` one round; `swap(space)` for Q4."""

    def __init__(self, space: GoalSpace, name: str, cfg: Config, seed: int = 0, features: Tensor | None = None):
        self.rng, self.student = np.random.default_rng(seed + 1), Student(cfg.eta, transfer=cfg.transfer)
        self.space, self.name, self.cfg, self.t = space, name, cfg, 0
        self.sampler = {"random": lambda: Sampler(space, cfg), "online_alp": lambda: OnlineALP(space, cfg),
                        "ek_online_alp": lambda: EKOnlineALP(space, cfg),
                        "oracle": lambda: Oracle(space, cfg, self.student),
                        "magellan": lambda: Magellan(space, cfg, features, seed)}[name]()
        self.comp, self.sampled, self.estimated = [self.student.family_competence(space)], [], {}
        self.times = np.zeros(len(space), dtype=int)
        self.q1: list = []  # (round, MAE of MAGELLAN, Eval-ALP, EK-Eval-ALP by `mae_by_family`) at each recompute
        self.eval_rng = np.random.default_rng([seed, 2])  # the evaluators' own draws: the run's stay as they were

    def step(self) -> None:
        sp, t, s = self.space, self.t, self.sampler
        goals = self.rng.choice(len(sp), self.cfg.episodes, p=s.probs(t))
        s.update(t, goals, self.student.attempt(sp, goals, self.rng))
        np.add.at(self.times, goals, 1)
        self.comp.append(self.student.family_competence(sp))
        self.sampled.append(np.bincount(sp.family[goals], minlength=len(FAMILIES)))
        if isinstance(s, Magellan) and (t + 1) % self.cfg.R == 0:
            self.estimated[t + 1] = np.array([s.estimate[sp.family == f].mean() for f in range(len(FAMILIES))])
            self.evaluate(t + 1)
        self.t += 1

    def evaluate(self, t: int) -> None:
        """Q1 at round t: MAGELLAN's current estimate, Eval-ALP's and EK-Eval-ALP's against the true competence."""
        sp, cfg, true = self.space, self.cfg, self.student.competence(self.space)
        ests = (self.sampler.estimate, eval_alp(true, cfg.eval_episodes, self.eval_rng),
                ek_eval_alp(true, sp.family, cfg.ek_eval_episodes, self.eval_rng))
        self.q1.append((t, *(mae_by_family(e, true, sp.family) for e in ests)))

    def swap(self, space: GoalSpace) -> None:
        """Replace every goal by `space`'s; the curves restart on the new goals."""
        self.space = space
        self.sampler.swap(space)
        self.comp, self.sampled, self.estimated = [self.student.family_competence(space)], [], {}
        self.times = np.zeros(len(space), dtype=int)
        self.q1 = []

    def result(self) -> dict:
        """`competence` (rounds+1, 5) true competence per family, `sampled` (rounds, 5) episodes per family,
        `estimated` {round: (5,) mean estimate per family} (MAGELLAN), `times_sampled` (G,), `estimate` (G,) the
        per-goal estimate now (NaN where none), `true` (G,) the true competence now, `sampler`."""
        s = self.sampler
        if isinstance(s, Magellan):
            s.estimate = s.model.predict()  # the estimate at the end of the run
        est = s.estimate if s.estimate is not None else np.full(len(self.space), np.nan)
        return dict(name=self.name, competence=np.array(self.comp), sampled=np.array(self.sampled),
                    estimated=dict(self.estimated), times_sampled=self.times.copy(), estimate=np.asarray(est, float),
                    true=self.student.competence(self.space), sampler=s,
                    q1={k: np.array([q[i] for q in self.q1]) for i, k in enumerate(Q1)} if self.q1 else None)


def run(space: GoalSpace, name: str, cfg: Config, seed: int = 0, features: Tensor | None = None) -> dict:
    """`cfg.rounds` rounds of sampler `name` on `space` (see `Run.result`)."""
    r = Run(space, name, cfg, seed, features)
    for _ in range(cfg.rounds):
        r.step()
    return r.result()


@stage
def study(space: GoalSpace, name: str, cfg: Config, seed: int = 0, features: Tensor | None = None,
          new_space: GoalSpace | None = None) -> dict:
    """`run`, then (with `new_space`) a copy of the trained run swapped to `new_space` for `cfg.swap_rounds` rounds:
    `{"main": run result, "swap": its result after the swap, with `at_swap` = (estimate, true) on the new goals
    right after the swap}`. Cached by the stage cache (a control recomputes only the samplers it changes)."""
    r = Run(space, name, cfg, seed, features)
    for _ in range(cfg.rounds):
        r.step()
    out = {"main": r.result()}
    if new_space is not None:
        r = copy.deepcopy(r)
        r.swap(new_space)
        est = r.sampler.estimate if r.sampler.estimate is not None else np.full(len(new_space), np.nan)
        at_swap = (np.asarray(est, float).copy(), r.student.competence(new_space))
        for _ in range(cfg.swap_rounds):
            r.step()
        out["swap"] = {**r.result(), "at_swap": at_swap}
    return out


def mae_never_sampled(res: dict, among: np.ndarray | None = None) -> float:
    """Mean |estimate − true competence| over the goals the run never sampled (NaN estimates count as missing),
    only those where `among` (a (G,) bool mask, e.g. the feasible goals) is true if given."""
    never = (res["times_sampled"] == 0) & (True if among is None else among)
    return float(np.nanmean(np.abs(res["estimate"][never] - res["true"][never])))


def mae_at_swap(res: dict) -> float:
    """Mean |estimate − true competence| over every new goal right after the swap (before any new outcome)."""
    est, true = res["at_swap"]
    return float(np.mean(np.abs(est - true)))


def q1_mae(res: dict, after: int, column: int = -1) -> dict[str, float]:
    """Each Q1 estimator's MAE (`mae_by_family` column, default the feasible goals) averaged over the recomputes
    after round `after` (MAGELLAN's untrained start left out)."""
    q, late = res["q1"], res["q1"]["rounds"] > after
    return {k: float(q[k][late, column].mean()) for k in Q1[1:]}


def rounds_to(curve: np.ndarray, level: float = 0.8) -> int:
    """First round at which `curve` (rounds+1,) reaches `level`; len(curve) if it never does (one past the end of
    the run: a lower bound on the true time, so a gap measured against it is a lower bound too)."""
    hit = np.flatnonzero(np.asarray(curve) >= level)
    return int(hit[0]) if len(hit) else len(curve)
