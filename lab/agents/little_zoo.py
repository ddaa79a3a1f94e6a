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

`Student` replaces the 80-GPU-hour SAC agent by a learner whose competence is known exactly: a skill s_f per
family f (grasp → plant → herbivore → carnivore, init 0.1); a feasible goal of family f succeeds with probability
∏_{k≤f} s_k, an impossible one never; practising f moves s_f += η · ∏_{k<f} s_k · (1 − s_f). Herbivore
success therefore rises while plants are learnt (transfer), and the true competence and true learning progress
of every goal are available to score the estimators and to drive the oracle sampler.
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
    """(tag, name) of every object of `split` ("train": 6 per category, "test": the 3 held out) plus water."""
    sl = slice(0, 6) if split == "train" else slice(6, 9)
    return [(c, n) for c in CATEGORIES for n in OBJECTS[c][sl]] + [("water", "water")]


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

    def text(self, i: int) -> str:
        """The goal as a prompt, in the shape of the paper's "Goal: Grow lion / You see: …"."""
        instr, target, scene = self.goals[i]
        return f"goal: {instr} {' '.join(target)} you see: " + " ".join(" ".join(o) for o in scene)


def _draw(rng, fam: int, objs: list) -> tuple:
    """One random goal of family `fam` (constructive for feasible families, rejection for impossible)."""
    by_tag = {t: [o for o in objs if o[0] == t] for t in CATEGORIES + ("water",)}
    pick = lambda t: by_tag[t][rng.integers(len(by_tag[t]))]
    while True:
        if fam == IMPOSSIBLE:
            instr = INSTRUCTIONS[rng.integers(2)]
            target = objs[rng.integers(len(objs))]
            scene = [objs[i] for i in rng.choice(len(objs), 4, replace=False)]
        else:
            instr = "grasp" if fam == 0 else "grow"
            target = objs[rng.integers(len(objs))] if fam == 0 else pick(CATEGORIES[fam])
            scene = [target] + ([pick("water")] if fam else []) + [pick(CATEGORIES[k]) for k in range(1, fam)]
            while len(scene) < 4:
                scene.append(objs[rng.integers(len(objs))])
            rng.shuffle(scene)
        scene = tuple(scene)
        if len(set(scene)) == 4 and family(instr, target, scene) == fam:
            return instr, target, scene


def make_goal_space(n_goals: int, seed: int = 0, split: str = "train") -> GoalSpace:
    """`n_goals` distinct goals with the paper's family proportions, drawn from `split`'s objects."""
    rng, objs, words = np.random.default_rng(seed), objects(split), vocabulary()
    index = {w: i for i, w in enumerate(words)}
    goals, fams, seen = [], [], set()
    for fam, count in enumerate(proportions(n_goals)):
        got = 0
        while got < count:
            g = _draw(rng, fam, objs)
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
    """Simulated learner: skills s (4,) for grasp → plant → herbivore → carnivore, learning rate η."""

    def __init__(self, eta: float = 0.01, init: float = 0.1):
        self.eta, self.s = eta, np.full(4, init)

    def family_competence(self) -> np.ndarray:
        """P(success) per family (5,): ∏_{k≤f} s_k for the feasible families, 0 for impossible goals."""
        return np.append(np.cumprod(self.s), 0.0)

    def competence(self, fam: np.ndarray) -> np.ndarray:
        """True competence C(g) of goals with families `fam`."""
        return self.family_competence()[fam]

    def attempt(self, fam: np.ndarray, rng) -> np.ndarray:
        """One episode per goal in order: success r ∈ {0, 1} drawn from the current competence, then practice."""
        out = np.zeros(len(fam))
        for i, f in enumerate(fam):
            out[i] = rng.random() < self.competence(np.array([f]))[0]
            if f != IMPOSSIBLE:
                prereq = np.prod(self.s[:f])
                self.s[f] += self.eta * prereq * (1 - self.s[f])
        return out
