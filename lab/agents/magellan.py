"""MAGELLAN (Gaven et al., ICML 2025): metacognitive predictions of learning progress for goal selection.

arXiv 2502.07709, official code `LorisGaven/MAGELLAN` (`magellan/goal_sampler.py`, `models.py`, `updater.py`,
`main.py`, configs `configs/little_zoo/local_gpu_config_*.yaml`). The agent learns its own competence
C_θ(g) = σ(f_θ(h(g))) (Sec. 3): h(g) the encoder's final hidden state of the goal prompt, f_θ the head
Linear(d, 128) → tanh → Linear(128, 1) (`SRHeadModuleFn`), trained online with BCE on (g, r) outcomes drawn
from a FIFO D of M = 5000 episodes with linear recency weights p_i ∝ i (`sr_update`, `main.py`). A FIFO B of
weight snapshots, one pushed every R sampler updates, |B| = int(N/R + 1), gives the delayed estimator
θ_{t−N} = B[0] (`update_buffer` / `set_weights`). Absolute learning progress over ALL goals,
ALP(g) = |C_{θ_t}(g) − C_{θ_{t−N}}(g)|, entries < 0.01 set to 0, recomputed every R updates; goals are drawn
ε-greedily ∝ ALP, ε_t = ε_end + (ε_start − ε_end)·exp(−t/ε_decay) (`MAGELLANGoalSampler`).

Baselines as in `goal_sampler.py`: uniform (`RandomGoalSampler`), Online-ALP — per-goal FIFO of the last 100
outcomes, ALP = |mean(newer half) − mean(older half)| (`OnlineGoalSampler`) — and EK-Online-ALP — the same over
expert buckets {grasp, plant, herbivore, carnivore}, the ε-branch uniform over 5 buckets incl. the impossible
one, the LP branch ∝ ALP over the 4 feasible buckets, then a uniform goal inside (`EKOnlineGoalSampler`); plus
an oracle that uses the true ALP of the simulated learner (`little_zoo.Student`).

This lab's toy (disclosed in the notebook): the LLM agent is replaced by `Student`; h(g) comes from a small
token encoder trained jointly with the head (the paper trains the LLM's `sr_adapters` LoRA jointly too): word
embeddings plus lexicon attributes (`little_zoo.lexicon_matrix`), one attention read of the scene queried by the
target object, one GELU layer — a 1-layer `transformers` Llama over the 11 goal tokens was too slow to re-score
25k goals every R rounds on a CPU. Several Adam steps per round instead of one; R, N and ε_decay scaled to the
shorter run. On a checkpoint, `features` (`goal_features`: a frozen pretrained LM's last hidden state of each
goal prompt) replace the token encoder; the head is trained on them.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from lab.agents.little_zoo import FAMILIES, IMPOSSIBLE, GoalSpace, Student, lexicon_matrix
from lab.core import params

CONTROLS = {
    "no_delay": "delay N = 0: |B| = int(0/R + 1) = 1, the delayed estimator is the current one, ALP ≡ 0 (uniform)",
    "one_hot_goals": "the estimator sees a one-hot goal id instead of the goal's tokens (no semantic sharing)",
}
SAMPLERS = ("random", "online_alp", "ek_online_alp", "magellan", "oracle")


def check_control(control: str) -> str:
    return params.check_control(control, CONTROLS)


@dataclass(frozen=True)
class Config:
    """Every size: goal space, learner, run length, estimator, MAGELLAN's schedule."""

    n_goals: int = 25_000  # the paper's "25k" set (same proportions)
    rounds: int = 250  # collection rounds (sampler updates)
    episodes: int = 96  # episodes per round (the paper: 32 envs x 64 steps, several episodes each)
    eta: float = 0.0133  # student learning rate η (per episode)
    d_embed: int = 16  # token embedding width
    d_model: int = 64  # h(g) width
    steps: int = 3  # estimator Adam steps per round (the paper: 1)
    batch: int = 256  # estimator minibatch (the paper's)
    buffer: int = 5000  # FIFO D (the paper's M)
    lr: float = 5e-3  # estimator Adam lr (the paper: 1e-4 with a 250M LLM)
    R: int = 8  # snapshot / ALP recompute period (the paper: 32)
    N: int = 24  # delay in sampler updates (the paper: 100) -> |B| = int(N/R + 1)
    eps_start: float = 1.0
    eps_end: float = 0.2
    eps_decay: float = 40.0  # (the paper: 320)
    threshold: float = 0.01  # ALP below it is 0 (the paper's)
    fifo: int = 100  # Online-ALP / EK per-goal or per-bucket outcome FIFO (the code's)
    goal_input: str = "tokens"  # "one_hot" under the `one_hot_goals` control

    @classmethod
    def for_scale(cls, scale: str, control: str = "", **overrides) -> Config:
        """Sizes for `scale` ("smoke" | "full"); `control` sets N = 0 or one-hot goal inputs; `overrides` any field."""
        if scale not in params.SCALES:
            raise ValueError(f"scale={scale!r} is unknown; use one of {', '.join(params.SCALES)}.")
        control = check_control(control)
        sizes = {} if scale == "smoke" else dict(rounds=1000, eta=0.0033, steps=6, eps_decay=160.0)
        if control == "no_delay":
            sizes["N"] = 0
        return cls(**{**sizes, **overrides}, goal_input="one_hot" if control == "one_hot_goals" else "tokens")

    @property
    def n_snapshots(self) -> int:
        """|B| = int(N/R + 1) (the official `update_buffer`)."""
        return int(self.N / self.R + 1)


def epsilon(t: int, cfg: Config) -> float:
    """ε_t = ε_end + (ε_start − ε_end) · exp(−t / ε_decay)."""
    return cfg.eps_end + (cfg.eps_start - cfg.eps_end) * np.exp(-t / cfg.eps_decay)


def eps_greedy(alp: np.ndarray, eps: float) -> np.ndarray:
    """Goal distribution: ε uniform + (1 − ε) ∝ ALP; uniform when Σ ALP = 0."""
    G = len(alp)
    if alp.sum() <= 0:
        return np.full(G, 1.0 / G)
    return eps / G + (1 - eps) * alp / alp.sum()


def recency_weights(n: int) -> np.ndarray:
    """Sampling probabilities over a FIFO of n outcomes, p_i ∝ i (i = 1 the oldest … n the newest)."""
    w = np.arange(1, n + 1, dtype=float)
    return w / w.sum()


def half_alp(outcomes) -> float:
    """Online-ALP of one FIFO: |mean(newer half) − mean(older half)|, 0 with fewer than 2 outcomes."""
    n = len(outcomes)
    if n < 2:
        return 0.0
    o = np.asarray(outcomes, dtype=float)
    return float(abs(o[n // 2:].mean() - o[: n // 2].mean()))


# ------------------------------------------------------------------------ the competence estimator

class Estimator(nn.Module):
    """C_θ(g) = σ(f_θ(h(g))): h from the goal's tokens (`embed`), a one-hot goal id embedding (the
    `one_hot_goals` control), or frozen checkpoint features; f_θ = Linear(d, 128) → tanh → Linear(128, 1)
    (`SRHeadModuleFn`)."""

    def __init__(self, space: GoalSpace, cfg: Config, features: Tensor | None = None):
        super().__init__()
        self.kind = "features" if features is not None else cfg.goal_input
        self.register_buffer("tokens", torch.as_tensor(space.tokens, dtype=torch.long), persistent=False)
        self.register_buffer("lexicon", torch.as_tensor(lexicon_matrix(space.words), dtype=torch.float32),
                             persistent=False)
        pairs, obj = torch.unique(self.tokens[:, 1:].reshape(-1, 2), dim=0, return_inverse=True)
        self.register_buffer("pairs", pairs, persistent=False)  # the distinct objects (tag id, name id)
        self.register_buffer("obj", obj.view(len(space), 5), persistent=False)  # target + scene as object ids
        if self.kind == "features":
            self.register_buffer("feats", features.float(), persistent=False)
            d = features.shape[1]
        elif self.kind == "one_hot":
            d = cfg.d_model
            self.ids = nn.Embedding(len(space), d)
        else:  # an object = its (tag, name) embeddings; one attention read of the scene queried by the target
            d, e = cfg.d_model, 2 * cfg.d_embed
            self.emb = nn.Embedding(len(space.words), cfg.d_embed)
            self.qkv = nn.Linear(e, 3 * e, bias=False)
            self.encoder = nn.Sequential(nn.Linear(cfg.d_embed + 3 * e, d), nn.GELU())
        self.head = nn.Sequential(nn.Linear(d, 128), nn.Tanh(), nn.Linear(128, 1))

    def embed(self, idx: Tensor) -> Tensor:
        """h(g) for goal indices idx (B,) -> (B, d)."""
        if self.kind == "features":
            return self.feats[idx]
        if self.kind == "one_hot":
            return self.ids(idx)
        words = self.lexicon @ self.emb.weight  # a word's vector + its lexicon attributes' vectors
        table = words[self.pairs].flatten(1)  # each distinct object once: (n_objects, e)
        q, k, v = (t[self.obj[idx]] for t in self.qkv(table).chunk(3, -1))  # (B, 5, e) each
        att = torch.softmax(q[:, :1] @ k[:, 1:].transpose(1, 2) / k.shape[-1] ** 0.5, -1)  # (B, 1, 4)
        read = (att @ v[:, 1:]).squeeze(1)  # the scene as seen from the target
        objs = table[self.obj[idx]]
        return self.encoder(torch.cat([words[self.tokens[idx, 0]], objs[:, 0], read, objs[:, 1:].mean(1)], 1))

    def forward(self, idx: Tensor) -> Tensor:
        """Logits f_θ(h(g)) (B,)."""
        return self.head(self.embed(idx)).squeeze(-1)

    @torch.no_grad()
    def predict(self, idx: Tensor | None = None, chunk: int = 8192) -> np.ndarray:
        """C_θ(g) for idx (default: every goal), in chunks."""
        idx = torch.arange(len(self.tokens)) if idx is None else idx
        return torch.cat([torch.sigmoid(self(idx[i:i + chunk])) for i in range(0, len(idx), chunk)]).double().numpy()


@torch.no_grad()
def goal_features(model, tokenizer, space: GoalSpace, device: str = "cpu", batch: int = 256) -> Tensor:
    """h(g) from a pretrained causal LM (the paper's Flan-T5 role): the final-layer hidden state at the last
    token of each goal prompt `space.text(i)` (right padding; the last non-pad position) -> (G, hidden) float."""
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    out = []
    for i in range(0, len(space), batch):
        enc = tokenizer([space.text(j) for j in range(i, min(i + batch, len(space)))], return_tensors="pt",
                        padding=True).to(device)
        h = model(**enc, output_hidden_states=True).hidden_states[-1]
        last = enc["attention_mask"].sum(1) - 1
        out.append(h[torch.arange(len(last)), last].float().cpu())
    return torch.cat(out)


# ------------------------------------------------------------------------ goal samplers

class Sampler:
    """Interface: `probs(t)` the goal distribution for round t; `update(t, goals, outcomes)` after it."""

    estimate: np.ndarray | None = None  # competence estimate per goal where the sampler has one (NaN: none)

    def __init__(self, space: GoalSpace, cfg: Config):
        self.space, self.cfg, self.G = space, cfg, len(space)

    def probs(self, t: int) -> np.ndarray:
        return np.full(self.G, 1.0 / self.G)

    def update(self, t: int, goals: np.ndarray, outcomes: np.ndarray) -> None:
        pass


class OnlineALP(Sampler):
    """Online-ALP: a FIFO of the last `fifo` outcomes per goal; ALP per goal; ε-greedy ∝ ALP over goals."""

    def __init__(self, space, cfg):
        super().__init__(space, cfg)
        self.fifos: dict[int, deque] = {}
        self.alp = np.zeros(self.G)
        self.estimate = np.full(self.G, np.nan)

    def probs(self, t):
        return eps_greedy(self.alp, epsilon(t, self.cfg))

    def update(self, t, goals, outcomes):
        for g, r in zip(goals, outcomes):
            q = self.fifos.setdefault(int(g), deque(maxlen=self.cfg.fifo))
            q.append(r)
            self.alp[g], self.estimate[g] = half_alp(q), np.mean(q)


class EKOnlineALP(Sampler):
    """EK-Online-ALP: expert buckets = the families; bucket FIFO + ALP; ε → uniform over the 5 buckets, else a
    feasible bucket ∝ ALP; then a uniform goal inside the bucket."""

    def __init__(self, space, cfg):
        super().__init__(space, cfg)
        self.fifos = [deque(maxlen=cfg.fifo) for _ in FAMILIES]
        self.sizes = np.bincount(space.family, minlength=len(FAMILIES))

    def probs(self, t):
        alp = np.array([half_alp(q) for q in self.fifos[:IMPOSSIBLE]] + [0.0])
        eps = epsilon(t, self.cfg)
        bucket = np.full(len(FAMILIES), 1 / len(FAMILIES)) if alp.sum() <= 0 else \
            eps / len(FAMILIES) + (1 - eps) * alp / alp.sum()
        return bucket[self.space.family] / self.sizes[self.space.family]

    def update(self, t, goals, outcomes):
        for g, r in zip(goals, outcomes):
            self.fifos[self.space.family[g]].append(r)


class Magellan(Sampler):
    """MAGELLAN: the estimator trained on D, snapshots in B, ALP = |C_θt − C_θ(t−N)| over all goals."""

    def __init__(self, space, cfg, features: Tensor | None = None, seed: int = 0):
        super().__init__(space, cfg)
        torch.manual_seed(seed)
        self.model = Estimator(space, cfg, features)
        self.delayed = copy.deepcopy(self.model).requires_grad_(False)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.snapshots: deque = deque(maxlen=cfg.n_snapshots)
        self.D_goal, self.D_r = deque(maxlen=cfg.buffer), deque(maxlen=cfg.buffer)
        self.alp = np.zeros(self.G)
        self.rng = np.random.default_rng(seed)
        self.estimate = self.model.predict()
        self.losses: list[float] = []

    def probs(self, t):
        return eps_greedy(self.alp, epsilon(t, self.cfg))

    def train_step(self) -> float:
        """One Adam step of BCE on `batch` outcomes of D drawn with p_i ∝ i (i = 1 oldest … |D| newest)."""
        pick = self.rng.choice(len(self.D_goal), self.cfg.batch, p=recency_weights(len(self.D_goal)))
        g = torch.as_tensor(np.asarray(self.D_goal)[pick])
        r = torch.as_tensor(np.asarray(self.D_r)[pick], dtype=torch.float32)
        loss = nn.functional.binary_cross_entropy_with_logits(self.model(g), r)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def update(self, t, goals, outcomes):
        self.D_goal.extend(int(g) for g in goals)
        self.D_r.extend(float(r) for r in outcomes)
        self.losses += [self.train_step() for _ in range(self.cfg.steps)]
        if (t + 1) % self.cfg.R == 0:
            self.estimate = self.model.predict()
            self.snapshots.append(({k: v.detach().clone() for k, v in self.model.state_dict().items()}, self.estimate))
            weights, delayed = self.snapshots[0]  # θ_{t−N}; its predictions on the fixed goal set were made when it
            self.delayed.load_state_dict(weights)  # was current (= self.delayed.predict(), a test checks it)
            self.alp = np.abs(self.estimate - delayed)
            self.alp[self.alp < self.cfg.threshold] = 0.0


class Oracle(Sampler):
    """The true-ALP oracle: |C_t(g) − C_{t−N}(g)| from the learner's exact competence, same schedule as MAGELLAN."""

    def __init__(self, space, cfg, student: Student):
        super().__init__(space, cfg)
        self.student, self.history = student, [student.family_competence()]
        self.alp = np.zeros(self.G)

    def probs(self, t):
        return eps_greedy(self.alp, epsilon(t, self.cfg))

    def update(self, t, goals, outcomes):
        self.history.append(self.student.family_competence())
        if (t + 1) % self.cfg.R == 0:
            fam_alp = np.abs(self.history[-1] - self.history[max(0, len(self.history) - 1 - self.cfg.N)])
            self.alp = fam_alp[self.space.family]
            self.alp[self.alp < self.cfg.threshold] = 0.0


# ------------------------------------------------------------------------ a run

def run(space: GoalSpace, name: str, cfg: Config, seed: int = 0, features: Tensor | None = None) -> dict:
    """Train a fresh `Student` with goals from sampler `name`; curves per round and end-of-run estimates.

    Returns `competence` (rounds+1, 5) true competence per family, `sampled` (rounds, 5) episodes per family,
    `estimated` {round: (5,) mean estimate per family} (samplers with an estimate), `times_sampled` (G,),
    `estimate` (G,) the final per-goal estimate (NaN where none), `true` (G,) the final true competence."""
    rng, student = np.random.default_rng(seed + 1), Student(cfg.eta)
    sampler = {"random": lambda: Sampler(space, cfg), "online_alp": lambda: OnlineALP(space, cfg),
               "ek_online_alp": lambda: EKOnlineALP(space, cfg), "oracle": lambda: Oracle(space, cfg, student),
               "magellan": lambda: Magellan(space, cfg, features, seed)}[name]()
    comp, sampled, estimated = [student.family_competence()], [], {}
    times = np.zeros(len(space), dtype=int)
    for t in range(cfg.rounds):
        goals = rng.choice(len(space), cfg.episodes, p=sampler.probs(t))
        outcomes = student.attempt(space.family[goals], rng)
        sampler.update(t, goals, outcomes)
        np.add.at(times, goals, 1)
        comp.append(student.family_competence())
        sampled.append(np.bincount(space.family[goals], minlength=len(FAMILIES)))
        if isinstance(sampler, Magellan) and (t + 1) % cfg.R == 0:
            estimated[t + 1] = np.array([sampler.estimate[space.family == f].mean() for f in range(len(FAMILIES))])
    if isinstance(sampler, Magellan):
        sampler.estimate = sampler.model.predict()  # the estimate at the end of the run
    est = sampler.estimate if sampler.estimate is not None else np.full(len(space), np.nan)
    return dict(name=name, competence=np.array(comp), sampled=np.array(sampled), estimated=estimated,
                times_sampled=times, estimate=np.asarray(est, dtype=float), true=student.competence(space.family),
                sampler=sampler)


def mae_never_sampled(res: dict) -> float:
    """Mean |estimate − true competence| over the goals the run never sampled (NaN estimates count as missing)."""
    never = res["times_sampled"] == 0
    return float(np.nanmean(np.abs(res["estimate"][never] - res["true"][never])))
