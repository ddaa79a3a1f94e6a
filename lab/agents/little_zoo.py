"""Little-Zoo's goal space and a simulated learner with ground-truth competence (MAGELLAN's environment).

MAGELLAN (Gaven et al., ICML 2025, arXiv 2502.07709) trains its LLM agent in Little-Zoo (official environment
`LorisGaven/LittleZoo`, text-only Gymnasium): a goal is an instruction (Grasp | Grow) on a target object plus a
scene of 4 objects drawn from furniture, plants, herbivores, carnivores and water (9 objects per category: 6 for
training goals, 3 held out). Feasibility (the paper's Sec. 4 / App. A): the target must be in the scene; Grow
needs water; a herbivore also needs a plant; a carnivore also needs a herbivore and a plant; furniture and water
cannot grow. The paper's "25k" training set holds 20,000 impossible, 4,000 grasp, 800 grow-plant, 160
grow-herbivore and 32 grow-carnivore goals; other sizes keep these proportions (`proportions`).

The object names and the tag words are this lab's (Little-Zoo writes "baby cow", "carrot seed"): every object is
written as `tag name` (e.g. `herbivore cow`), and a small lexicon says that plants, herbivores and carnivores
are living and the latter two animals (`lexicon_matrix`) — the semantic prior a from-scratch encoder needs to
know that a lion is an animal that eats animals, which the paper's Flan-T5 brings from pre-training.

`Student` replaces the 80-GPU-hour SAC agent by a learner whose competence is known exactly. Little-Zoo gives every
goal of a family the same plan and horizon (`littlezoo.py`: 3 / 6 / 10 / 15 steps); what differs between goals of a
family is the object names the LLM policy must ground (the prompt says "baby lion", never "carnivore"), and the
paper measures competence on held-out names apart (`test_policy` on the test goals; the `adaptation_test` swap of
Q4). So the learner has a skill s_f per family f (grasp → plant → herbivore → carnivore, init 0.1) for the shared
procedure and a name-specific skill v_x (init 0.1) for growing object x; the grow step of target x succeeds with
w_x = τ·s_f + (1 − τ)·v_x, τ = `transfer` the share that carries over to every name of the family. A grasp goal
succeeds with s_0, a grow goal of family f with ∏_{k<f} s_k · w_x, an impossible one never; practising it moves
s_f and v_x by η · ∏_{k<f} s_k · (1 − ·). Herbivore success rises while plants are learnt (transfer between
families); τ = 1 is one skill per family (the learner of earlier versions: any carnivore goal practised teaches
all 32), τ < 1 leaves a part to learn per name, and a name never practised (a held-out one) starts at
τ·s_f + (1 − τ)·0.1. The paper gives no value for τ; the notebook exposes it. True competence and true learning
progress of every goal score the estimators and drive the oracle sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FAMILIES = ("grasp", "grow plant", "grow herbivore", "grow carnivore", "impossible")
IMPOSSIBLE = 4
CATEGORIES = ("furniture", "plant", "herbivore", "carnivore")
OBJECTS = {  # 6 training objects + 3 held out per category (the held-out ones: the goal-space swap, unseen goals)
    "furniture": ("chair", "table", "sofa", "bed", "lamp", "shelf", "desk", "stool", "bench"),
    "plant": ("carrot", "potato", "bean", "tomato", "berry", "pea", "lettuce", "pumpkin", "cabbage"),
    "herbivore": ("cow", "sheep", "goat", "rabbit", "pig", "deer", "horse", "zebra", "giraffe"),
    "carnivore": ("lion", "wolf", "tiger", "bear", "fox", "lynx", "jaguar", "hyena", "cougar"),
}
INSTRUCTIONS = ("grasp", "grow")
LEXICON = {"plant": ("living",), "herbivore": ("living", "animal"), "carnivore": ("living", "animal")}  # attributes
PROPORTIONS = (4_000, 800, 160, 32, 20_000)  # the paper's 25k set in FAMILIES order (impossible last)


def objects(split: str = "train") -> list[tuple[str, str]]:
    """(tag, name) of every object of `split` ("train": 6 per category plus water, "test": the 3 held out)."""
    if split == "train":
        return [(c, n) for c in CATEGORIES for n in OBJECTS[c][:6]] + [("water", "water")]
    return [(c, n) for c in CATEGORIES for n in OBJECTS[c][6:]]


def vocabulary() -> list[str]:
    """Every word of every goal (both splits): instructions, tags, names, and the prompt's glue words."""
    names = [n for c in CATEGORIES for n in OBJECTS[c]]
    return list(INSTRUCTIONS) + list(CATEGORIES) + ["water"] + names + ["goal:", "you", "see:", "living", "animal"]


def lexicon_matrix(words: list[str]) -> np.ndarray:
    """(V, V) 0/1: row w marks w itself and its LEXICON attributes (a herbivore and a carnivore share "animal"),
    so an encoder's embedding of w can be the sum of its own vector and its attributes' vectors."""
    index = {w: i for i, w in enumerate(words)}
    M = np.eye(len(words))
    for tag, attrs in LEXICON.items():
        for a in attrs:
            M[index[tag], index[a]] = 1.0
    return M


def family(instr: str, target: tuple[str, str], scene: tuple[tuple[str, str], ...]) -> int:
    """The goal's family index in FAMILIES (0 grasp … 3 grow carnivore, 4 impossible) by Little-Zoo's rules."""
    tags = [t for t, _ in scene]
    if target not in scene:
        return IMPOSSIBLE
    if instr == "grasp":
        return 0
    if target[0] in ("furniture", "water") or "water" not in tags:
        return IMPOSSIBLE
    need = {"plant": (), "herbivore": ("plant",), "carnivore": ("plant", "herbivore")}[target[0]]
    return 1 + len(need) if all(t in tags for t in need) else IMPOSSIBLE


def proportions(n_goals: int) -> tuple[int, ...]:
    """Goals per family for a goal space of `n_goals` with the paper's 25k proportions (at least 1 each)."""
    counts = [max(1, round(p * n_goals / sum(PROPORTIONS))) for p in PROPORTIONS]
    counts[IMPOSSIBLE] += n_goals - sum(counts)
    return tuple(counts)


@dataclass
class GoalSpace:
    """Goals as parallel arrays: `family` (G,), `tokens` (G, 11) word ids of
    [instr, tag(target), name(target), tag(o1), name(o1), …, tag(o4), name(o4)], and `goals` (the tuples)."""

    goals: list
    family: np.ndarray
    tokens: np.ndarray
    words: list[str] = field(default_factory=vocabulary)

    def __len__(self) -> int:
        return len(self.goals)

    def __stage_key__(self):
        """What identifies the space for the stage cache (the tokens spell out every goal)."""
        return self.family, self.tokens, self.words

    @property
    def target(self) -> np.ndarray:
        """Word id of each goal's target name (G,)."""
        return self.tokens[:, 2]

    def text(self, i: int) -> str:
        """The goal as a prompt, in the shape of the paper's "Goal: Grow lion / You see: …"."""
        instr, target, scene = self.goals[i]
        return f"goal: {instr} {' '.join(target)} you see: " + " ".join(" ".join(o) for o in scene)


def _draw(rng, fam: int, objs: list, targets: list) -> tuple:
    """One random goal of family `fam`: target among `targets`, the rest of the scene among `objs` (constructive
    for feasible families, rejection for impossible)."""
    by_tag = {t: [o for o in objs if o[0] == t] for t in CATEGORIES + ("water",)}
    pick = lambda t: by_tag[t][rng.integers(len(by_tag[t]))]
    of = {c: [o for o in targets if o[0] == c] for c in CATEGORIES}
    while True:
        if fam == IMPOSSIBLE:
            instr = INSTRUCTIONS[rng.integers(2)]
            target = targets[rng.integers(len(targets))]
            scene = [objs[i] for i in rng.choice(len(objs), 4, replace=False)]
            if target not in objs:  # a held-out target is always in the scene (the official `generate_goals`)
                scene[0] = target
                rng.shuffle(scene)
        else:
            instr = "grasp" if fam == 0 else "grow"
            target = targets[rng.integers(len(targets))] if fam == 0 else \
                of[CATEGORIES[fam]][rng.integers(len(of[CATEGORIES[fam]]))]
            scene = [target] + ([pick("water")] if fam else []) + [pick(CATEGORIES[k]) for k in range(1, fam)]
            while len(scene) < 4:
                scene.append(objs[rng.integers(len(objs))])
            rng.shuffle(scene)
        scene = tuple(scene)
        if len(set(scene)) == 4 and family(instr, target, scene) == fam:
            return instr, target, scene


def make_goal_space(n_goals: int, seed: int = 0, split: str = "train") -> GoalSpace:
    """`n_goals` distinct goals with the paper's family proportions. "train": targets and scenes of training objects;
    "test": a held-out target in a scene of training objects and water (the official `generate_goals` with
    `train=False`), the unseen goals of the paper's Q3 and the goal-space swap (Q4)."""
    rng, words = np.random.default_rng(seed), vocabulary()
    objs, targets = objects("train"), objects(split)
    index = {w: i for i, w in enumerate(words)}
    goals, fams, seen = [], [], set()
    for fam, count in enumerate(proportions(n_goals)):
        got = 0
        while got < count:
            g = _draw(rng, fam, objs, targets)
            if g not in seen:
                seen.add(g)
                goals.append(g)
                fams.append(fam)
                got += 1
    order = rng.permutation(len(goals))
    goals = [goals[i] for i in order]
    tokens = np.array([[index[g[0]], index[g[1][0]], index[g[1][1]]] + [index[w] for o in g[2] for w in o]
                       for g in goals])
    return GoalSpace(goals, np.asarray(fams)[order], tokens, words)


class Student:
    """Simulated learner: family skills s (4,) for grasp → plant → herbivore → carnivore, a name-specific grow skill
    v (V,) per word of `vocabulary()`, share τ = `transfer` of the grow step common to the family, learning rate η."""

    def __init__(self, eta: float = 0.01, init: float = 0.1, transfer: float = 1.0):
        self.eta, self.tau = eta, transfer
        self.s, self.v = np.full(4, init), np.full(len(vocabulary()), init)

    def state(self) -> tuple[np.ndarray, np.ndarray]:
        """A copy of (s, v), for the oracle's delayed competence."""
        return self.s.copy(), self.v.copy()

    def competence(self, space: GoalSpace, state: tuple | None = None) -> np.ndarray:
        """True competence C(g) of every goal of `space` (G,): s_0 for grasp, ∏_{k<f} s_k · (τ s_f + (1 − τ) v_x)
        for a grow goal of family f and target x, 0 for impossible goals; `state` an earlier `state()`."""
        s, v = state or (self.s, self.v)
        f = np.minimum(space.family, 3)
        pre = np.append(1.0, np.cumprod(s))[f]  # ∏_{k<f} s_k
        w = np.where(f == 0, s[0], self.tau * s[f] + (1 - self.tau) * v[space.target])
        return np.where(space.family == IMPOSSIBLE, 0.0, pre * w)

    def family_competence(self, space: GoalSpace, state: tuple | None = None) -> np.ndarray:
        """Mean true competence of each family's goals in `space` (5,)."""
        c = self.competence(space, state)
        return np.array([c[space.family == f].mean() for f in range(len(FAMILIES))])

    def attempt(self, space: GoalSpace, goals: np.ndarray, rng) -> np.ndarray:
        """One episode per goal index in order: success r ∈ {0, 1} drawn from the current competence, then practice
        (s_f and, for a grow goal, v_x move by η · ∏_{k<f} s_k · (1 − ·))."""
        out = np.zeros(len(goals))
        for i, g in enumerate(goals):
            f, x = int(space.family[g]), int(space.target[g])
            if f == IMPOSSIBLE:
                out[i] = rng.random() < 0.0
                continue
            reach = np.prod(self.s[:f])
            w = self.s[0] if f == 0 else self.tau * self.s[f] + (1 - self.tau) * self.v[x]
            out[i] = rng.random() < reach * w
            self.s[f] += self.eta * reach * (1 - self.s[f])
            if f:
                self.v[x] += self.eta * reach * (1 - self.v[x])
        return out
