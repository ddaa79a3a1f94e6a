"""A verbose automaton trace: a serial task whose chain of thought is mostly "textual coherence".

States Z_S, `n_actions` action tokens, each a fixed random permutation of the states (permutations, so the final
state stays uniform and cannot be guessed from a collapsed image; composing random permutations of 5 states needs
serial computation). One problem, with step-indexed action tokens `Tt=a` ("step t takes action a") that make
the action lookup one attention hop from the trace's index token T_t:

    prompt    P = <bos> start s0 | T1=a1 T2=a2 ... Tn=an | ?
    trace     C = T1 -> s1 ;  T2 -> s2 ;  ...  Tn -> sn ;     (L = 4 tokens a step, 3 of them fixed)
    solution  S = ans sn <eos>

(A prompt spelling `T1 a1 T2 a2 ...` as two tokens a step needs a two-layer induction circuit for the same lookup:
with it the tiny CoT model of `lab.reasoning.latent_tokens` was at 50-61 % after 250 steps (seeds 0, 3, 7),
with this one at 100 %.)

A problem is (start, actions); one in `test_every` of them (a fixed hash of the problem's index, the same for every
seed) is held out: `sample(split="train")`, what every trainer draws, never returns one, and `split="test"` returns
only those, so evaluation problems are never seen in training (the smoke task has only 4 · 4⁵ = 4,096 problems, and
a trainer draws ~13,000).

Ids are those of `lab.models.tokenizer.word_tokenizer(task.words)` (specials first), so tensors built here
agree with the tokenizer's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from lab.models.tokenizer import SPECIALS

KEYWORDS = ("start", "|", "?", "->", ";", "ans")
STEP_LEN = 4  # tokens of one trace step: T_t -> s_t ;


@dataclass(frozen=True)
class Automaton:
    n_states: int = 5
    n_actions: int = 6
    n_steps: int = 8
    seed: int = 0  # seeds the action maps (part of the task)
    test_every: int = 5  # one problem in `test_every` is held out for evaluation

    @cached_property
    def perms(self) -> torch.Tensor:
        """(n_actions, n_states): next state of every (action, state)."""
        g = torch.Generator().manual_seed(10_000 + self.seed)
        return torch.stack([torch.randperm(self.n_states, generator=g) for _ in range(self.n_actions)])

    @property
    def words(self) -> list[str]:
        """The vocabulary after the specials: keywords, states s*, step indices T*, step-indexed actions Tt=a*."""
        return (list(KEYWORDS) + [f"s{i}" for i in range(self.n_states)] + [f"T{t + 1}" for t in range(self.n_steps)]
                + [f"T{t + 1}=a{a}" for t in range(self.n_steps) for a in range(self.n_actions)])

    @cached_property
    def ids(self) -> dict[str, int]:
        return {w: i for i, w in enumerate(list(SPECIALS) + self.words)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.words)

    def state_id(self, s: torch.Tensor) -> torch.Tensor:
        return self.ids["s0"] + s

    def index(self, start: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Each problem's index in 0 .. n_states · n_actions^n_steps − 1 (start, then the actions in base n_actions)."""
        digits = self.n_actions ** torch.arange(self.n_steps, dtype=torch.int64)
        return start.long() * self.n_actions ** self.n_steps + (actions.long() * digits).sum(-1)

    def held_out(self, start: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """True for the test problems: bits 16-31 of a multiplicative (Knuth) hash of the index, mod `test_every`."""
        h = (self.index(start, actions) * 2654435761) % 2**32  # < 2^63 for up to ~3·10^9 problems
        return (h >> 16) % self.test_every == 0

    def sample(self, n: int, generator: torch.Generator, split: str = "train") -> dict[str, torch.Tensor]:
        """`start` (n,), `actions` (n, n_steps), `states` (n, n_steps): s_t after action a_t; problems drawn uniformly
        from the `split` ("train", "test": the held-out ones, or "all")."""
        if split not in ("train", "test", "all"):
            raise ValueError(f"split must be 'train', 'test' or 'all', not {split!r}")
        starts, acts, got = [], [], 0
        while got < n:
            start = torch.randint(self.n_states, (n,), generator=generator)
            actions = torch.randint(self.n_actions, (n, self.n_steps), generator=generator)
            if split != "all":
                keep = self.held_out(start, actions) == (split == "test")
                start, actions = start[keep], actions[keep]
            starts.append(start)
            acts.append(actions)
            got += len(start)
        start, actions = torch.cat(starts)[:n], torch.cat(acts)[:n]
        states, s = [], start
        for t in range(self.n_steps):
            s = self.perms[actions[:, t], s]
            states.append(s)
        return {"start": start, "actions": actions, "states": torch.stack(states, 1)}

    def encode(self, ex: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids of P (n, n_steps + 6), C (n, 4 n_steps) and S (n, 3) for sampled problems."""
        v, n = self.ids, len(ex["start"])
        col = lambda w: torch.full((n, 1), v[w])
        t = torch.arange(self.n_steps).expand(n, -1)
        steps = t + v["T1"]  # (n, n_steps) T_t ids
        acts = v["T1=a0"] + t * self.n_actions + ex["actions"]  # T1=a1 T2=a2 ...
        prompt = torch.cat([col("<bos>"), col("start"), self.state_id(ex["start"])[:, None], col("|"), acts,
                            col("|"), col("?")], 1)
        trace = torch.stack([steps, torch.full_like(steps, v["->"]), self.state_id(ex["states"]),
                             torch.full_like(steps, v[";"])], 2).reshape(n, -1)
        solution = torch.cat([col("ans"), self.state_id(ex["states"][:, -1])[:, None], col("<eos>")], 1)
        return prompt, trace, solution
