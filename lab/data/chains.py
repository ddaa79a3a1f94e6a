"""Permutation chains: a memorisation language for tiny MoE models (FloE toy, Zhou et al., ICML 2025).

The vocabulary is split into `n_domains` ranges of `span` tokens; each domain has a fixed random
permutation π of its range. A sequence picks a domain and a start token, then continues with
next = π(current) with probability `p_next`, else a uniform token of the same range. A model can only
beat the entropy floor by memorising the n_domains·span transitions, which it stores in its FFNs —
so the experts matter, and compressing them shows up in the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class PermutationChains:
    n_domains: int = 4
    span: int = 31
    p_next: float = 0.9
    length: int = 64
    seed: int = 0  # seeds the permutations (part of the task)

    @property
    def vocab_size(self) -> int:
        return self.n_domains * self.span

    @cached_property
    def pi(self) -> torch.Tensor:
        """Successor of every token (vocab_size,): a permutation within each domain's range."""
        g = torch.Generator().manual_seed(self.seed)
        return torch.cat([d * self.span + torch.randperm(self.span, generator=g) for d in range(self.n_domains)])

    def entropy_floor(self) -> float:
        """Per-token loss (nats) of the true chain, the best any model can do after the first token."""
        p, q = self.p_next + (1 - self.p_next) / self.span, (1 - self.p_next) / self.span
        return -(p * math.log(p) + (self.span - 1) * q * math.log(q))

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """`input_ids` (n, length) and `labels` (= input_ids; the model shifts them)."""
        dom = torch.randint(self.n_domains, (n, 1), generator=generator) * self.span  # (n, 1) range start
        jump = torch.rand(n, self.length, generator=generator) >= self.p_next  # (n, T)
        rand = dom + torch.randint(self.span, (n, self.length), generator=generator)  # (n, T)
        x = torch.empty(n, self.length, dtype=torch.long)
        x[:, 0] = rand[:, 0]
        for t in range(1, self.length):
            x[:, t] = torch.where(jump[:, t], rand[:, t], self.pi[x[:, t - 1]])
        return {"input_ids": x, "labels": x.clone()}
