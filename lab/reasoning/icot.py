"""iCoT — stepwise internalisation of chain-of-thought (Deng, Choi & Shieber, "From Explicit CoT to Implicit CoT:
Learning to Internalize CoT Step by Step", 2024, arXiv 2405.14838; official code `da03/Internalize_CoT_Step_by_Step`,
`src/train.py`), the implicit-reasoning baseline of Token Assorted (Su et al., ICML 2025, Table 4.3).

The model trains on P ⊕ C ⊕ S while the CoT tokens are deleted from the left as training goes on: at training step
t, `scheduled(t)` = ⌊|C| · t / (remove_frac · steps)⌋ tokens (the official code adds one every
`steps_per_removed_token` steps, from `--remove_per_epoch`), plus a per-example offset o drawn with
P(o) = (1 − e^{−λ}) e^{−λo}, o < 100, the rest of the mass on o = 99 (`compute_lambda_distribution`; λ =
`--removal_smoothing_lambda` 4, the README's runs). Once the schedule passes |C| every example is P ⊕ S, and at test
time the model answers from P directly. The loss is on the response (what is left of C, then S), as for CoT.

Differences from the official code: the schedule counts this lab's training steps, not epochs (the last
`1 − remove_frac` of the steps train with no CoT at all, where the official runs go on until validation picks a model
among the fully internalised ones); the optimizer is not reset when the count grows (`--reset_optimizer`), because
the lab's trainer (`lab.models.train`) owns it; positions are not kept (`--keep_position` off, as in the README's runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lab.data.automaton import Automaton


def removal_offsets(lam: float = 4.0, truncate: int = 100) -> torch.Tensor:
    """P(o) = (1 − e^{−λ}) e^{−λo} for o = 0 … truncate − 1, the remaining mass added to the last (official
    `compute_lambda_distribution`); λ = inf: always 0."""
    if math.isinf(lam):
        p = torch.zeros(truncate, dtype=torch.float64)
        p[0] = 1.0
        return p
    p = (1 - math.exp(-lam)) * torch.exp(-lam * torch.arange(truncate, dtype=torch.float64))
    p[-1] += 1 - p.sum()
    return p


@dataclass(frozen=True)
class ICoTTask:
    """Training batches of iCoT on an automaton task. The trainer draws one batch per step, in order; the task counts
    them (`t`, not a field: not part of the trained-model cache key). Build a fresh task for every training run."""

    task: Automaton
    steps: int  # the training run's steps: the schedule removes all of C by remove_frac · steps
    remove_frac: float = 0.75
    lam: float = 4.0
    pad: int = 0

    def __post_init__(self):
        object.__setattr__(self, "t", 0)

    def scheduled(self, t: int, n_cot: int) -> int:
        """CoT tokens removed at step t (before the offset): ⌊n_cot · t / (remove_frac · steps)⌋."""
        return math.floor(n_cot * t / max(1.0, self.remove_frac * self.steps))

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        ex = self.task.sample(n, generator)
        P, C, S = self.task.encode(ex)
        off = torch.multinomial(removal_offsets(self.lam), n, replacement=True, generator=generator)
        k = (self.scheduled(self.t, C.shape[1]) + off).clamp(max=C.shape[1])
        object.__setattr__(self, "t", self.t + 1)
        seqs = [torch.cat([P[i], C[i, int(k[i]):], S[i]]) for i in range(n)]
        x = nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=self.pad)
        labels = x.masked_fill(x == self.pad, -100)
        labels[:, : P.shape[1]] = -100  # loss on the response only
        return {"input_ids": x, "labels": labels}
