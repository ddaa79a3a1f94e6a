"""MAGELLAN (Gaven et al., ICML 2025): metacognitive predictions of learning progress for goal selection.

arXiv 2502.07709, official code `LorisGaven/MAGELLAN` (`magellan/goal_sampler.py`, `models.py`, `updater.py`,
`main.py`, configs `configs/little_zoo/local_gpu_config_*.yaml`). The agent learns its own competence
C_θ(g) = σ(f_θ(h(g))) (Sec. 3): h(g) the encoder's final hidden state of the goal prompt, f_θ the head
Linear(d, 128) → tanh → Linear(128, 1) (`SRHeadModuleFn`), trained online with BCE on (g, r) outcomes drawn
from a FIFO D of M = 5000 episodes with linear recency weights p_i ∝ i (`sr_update`, `main.py`). A FIFO B of
weight snapshots, one pushed every R sampler updates, |B| = int(N/R + 1), gives the delayed estimator
θ_{t−N} = B[0] (`update_buffer` / `set_weights`). Absolute learning progress over ALL goals,
ALP(g) = |C_{θ_t}(g) − C_{θ_{t−N}}(g)|, entries < 0.01 set to 0, recomputed every R updates; goals are drawn
ε-greedily ∝ ALP, ε_t = ε_end + (ε_start − ε_end)·exp(−t/ε_decay) (`MAGELLANGoalSampler`). This module holds the
method (config, estimator, MAGELLAN's sampler); `magellan_study` the baselines, the training runs and the
goal-space swap; `little_zoo` the goal space and the simulated learner.

Goal-space swap (the paper's Q4): the goals are replaced by held-out-object goals and D is emptied; the weights,
their snapshots B and the step counter carry over, and ALP is recomputed on the new goals at once (`swap`).

This lab's toy (disclosed in the notebook): the LLM agent is replaced by `little_zoo.Student`; h(g) comes from a
small token encoder trained jointly with the head (the paper trains the LLM's `sr_adapters` LoRA jointly too): word
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

from lab.agents.little_zoo import GoalSpace, lexicon_matrix
from lab.core import params

CONTROLS = {
    "no_delay": "delay N = 0: |B| = int(0/R + 1) = 1, the delayed estimator is the current one, ALP ≡ 0 (uniform)",
    "one_hot_goals": "the estimator sees a one-hot goal id instead of the goal's tokens (no semantic sharing)",
    "shuffled_alp": "MAGELLAN's ALP values permuted across the goals at every recompute: the same concentration of "
                    "sampling, none of the information about which goals progress",
}


def check_control(control: str) -> str:
    return params.check_control(control, CONTROLS)


@dataclass(frozen=True)
class Config:
    """Every size: goal space, learner, run length, estimator, MAGELLAN's schedule, the swap."""

    n_goals: int = 25_000  # the paper's "25k" set (same proportions)
    rounds: int = 400  # collection rounds (sampler updates)
    episodes: int = 96  # episodes per round (the official run: 32 envs × 2 steps = 64 transitions, a few episodes)
    eta: float = 0.0133  # student learning rate η (per episode)
    transfer: float = 0.5  # τ: share of a grow skill common to every name of the family (`little_zoo.Student`)
    swap_rounds: int = 150  # rounds on held-out-object goals after the goal-space swap (Q4)
    d_embed: int = 16  # token embedding width
    d_model: int = 64  # h(g) width
    steps: int = 3  # estimator Adam steps per round (the paper: 1)
    batch: int = 256  # estimator minibatch (the paper's)
    buffer: int = 5000  # FIFO D (the paper's M; here ~52 rounds ≈ 2N of outcomes, in the official runs 5-8 N)
    lr: float = 5e-3  # estimator Adam lr (the paper: 1e-4 with a 250M LLM)
    R: int = 8  # snapshot / ALP recompute period (the paper: 32)
    N: int = 24  # delay in sampler updates (the paper: 100) -> |B| = int(N/R + 1)
    eps_start: float = 1.0
    eps_end: float = 0.2
    eps_decay: float = 40.0  # (the paper: 320)
    threshold: float = 0.01  # ALP below it is 0 (the paper's)
    fifo: int = 100  # Online-ALP / EK per-goal or per-bucket outcome FIFO (the code's)
    eval_episodes: int = 1  # Eval-ALP: dedicated evaluation episodes per goal at every recompute (Q1 only)
    ek_eval_episodes: int = 64  # EK-Eval-ALP: evaluation episodes per expert bucket at every recompute (Q1 only)
    goal_input: str = "tokens"  # "one_hot" under the `one_hot_goals` control
    shuffle_alp: bool = False  # True under the `shuffled_alp` control

    @classmethod
    def for_scale(cls, scale: str, control: str = "", **overrides) -> Config:
        """Sizes for `scale` ("smoke" | "full"); `control` sets N = 0 or one-hot goal inputs; `overrides` any field."""
        if scale not in params.SCALES:
            raise ValueError(f"scale={scale!r} is unknown; use one of {', '.join(params.SCALES)}.")
        control = check_control(control)
        sizes = {} if scale == "smoke" else dict(rounds=1600, eta=0.0033, steps=6, eps_decay=160.0, swap_rounds=600)
        if control == "no_delay":
            sizes["N"] = 0
        return cls(**{**sizes, **overrides}, goal_input="one_hot" if control == "one_hot_goals" else "tokens",
                   shuffle_alp=control == "shuffled_alp")

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


# ------------------------------------------------------------------------ the competence estimator

class Estimator(nn.Module):
    """C_θ(g) = σ(f_θ(h(g))): h from the goal's tokens (`embed`), a one-hot goal id embedding (the
    `one_hot_goals` control), or frozen checkpoint features; f_θ = Linear(d, 128) → tanh → Linear(128, 1)
    (`SRHeadModuleFn`)."""

    def __init__(self, space: GoalSpace, cfg: Config, features: Tensor | None = None):
        super().__init__()
        self.kind = "features" if features is not None else cfg.goal_input
        self.register_buffer("lexicon", torch.as_tensor(lexicon_matrix(space.words), dtype=torch.float32),
                             persistent=False)
        self.set_space(space)
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

    def set_space(self, space: GoalSpace) -> None:
        """Index the goals of `space` (same vocabulary): their tokens and their objects as (tag, name) pairs. The
        goal-space swap calls it with the new goals; a one-hot estimator's new ids get fresh, untrained rows."""
        if getattr(self, "kind", "") == "features" and hasattr(self, "feats"):
            raise ValueError("checkpoint features are computed for one goal space; the swap needs the token encoder.")
        self.register_buffer("tokens", torch.as_tensor(space.tokens, dtype=torch.long), persistent=False)
        pairs, obj = torch.unique(self.tokens[:, 1:].reshape(-1, 2), dim=0, return_inverse=True)
        self.register_buffer("pairs", pairs, persistent=False)  # the distinct objects (tag id, name id)
        self.register_buffer("obj", obj.view(len(space), 5), persistent=False)  # target + scene as object ids
        if hasattr(self, "ids"):
            if self.ids.num_embeddings != len(space):
                raise ValueError(f"a one-hot estimator of {self.ids.num_embeddings} goals cannot index {len(space)}.")
            with torch.no_grad():
                self.ids.weight.normal_()

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
    """Interface: `probs(t)` the goal distribution for round t; `update(t, goals, outcomes)` after it; `swap(space)`
    when the goal space is replaced. The uniform sampler (`RandomGoalSampler`)."""

    estimate: np.ndarray | None = None  # competence estimate per goal where the sampler has one (NaN: none)

    def __init__(self, space: GoalSpace, cfg: Config):
        self.space, self.cfg, self.G = space, cfg, len(space)

    def probs(self, t: int) -> np.ndarray:
        return np.full(self.G, 1.0 / self.G)

    def update(self, t: int, goals: np.ndarray, outcomes: np.ndarray) -> None:
        pass

    def swap(self, space: GoalSpace) -> None:
        self.space, self.G = space, len(space)


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
        self.snapshots.append(({k: v.detach().clone() for k, v in self.model.state_dict().items()}, self.estimate))
        self.losses: list[float] = []  # θ_0 is B's first entry, as the official sampler pushes it at initialisation

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

    def recompute(self) -> None:
        """ALP over every goal against B[0] (its predictions cached when it was current), entries < 0.01 -> 0."""
        weights, delayed = self.snapshots[0]  # θ_{t−N}; its predictions on the goal set were made when it was
        self.delayed.load_state_dict(weights)  # current (= self.delayed.predict(), a test checks it)
        self.alp = np.abs(self.estimate - delayed)
        self.alp[self.alp < self.cfg.threshold] = 0.0
        if self.cfg.shuffle_alp:  # the control: the values kept, their goals drawn at random
            self.alp = self.rng.permutation(self.alp)

    def update(self, t, goals, outcomes):
        self.D_goal.extend(int(g) for g in goals)
        self.D_r.extend(float(r) for r in outcomes)
        self.losses += [self.train_step() for _ in range(self.cfg.steps)]
        if (t + 1) % self.cfg.R == 0:
            self.estimate = self.model.predict()
            self.snapshots.append(({k: v.detach().clone() for k, v in self.model.state_dict().items()}, self.estimate))
            self.recompute()

    def swap(self, space):
        """Q4: new goals; D emptied; every snapshot of B re-scores the new goals; ALP recomputed on them now."""
        super().swap(space)
        for m in (self.model, self.delayed):
            m.set_space(space)
        if self.model.kind == "one_hot":  # fresh rows for the new ids: forget their Adam moments
            self.opt.state.pop(self.model.ids.weight, None)
        self.D_goal.clear()
        self.D_r.clear()
        for i, (weights, _) in enumerate(self.snapshots):
            self.delayed.load_state_dict(weights)
            self.snapshots[i] = (weights, self.delayed.predict())
        self.estimate = self.model.predict()
        if self.snapshots:
            self.recompute()
        else:
            self.alp = np.zeros(self.G)
