"""A sparse n-th order Markov language with a known entropy (the over-tokenized toy's data).

Vocabulary 0..V−1, token 0 is BOS/pad and is never emitted. The next token depends on the last `order` tokens
(x_{t−order+1}, …, x_t), a context c = Σ_j x_{t−j} V^j (the current token the least significant digit, the
convention of the over-tokenized n-gram ids). Every context draws `support` distinct tokens of 1..V−1 and a
Dirichlet(1) distribution over them, from the task's seed. A sequence starts with BOS and tokens before it read
as 0, so every position has a defined context. Batches are fresh draws (no repetition), and `true_nll` gives
−log p(x_t | context) of each position, so a model's excess loss CE − H* is measured on the very same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class SparseMarkov:
    vocab: int = 64
    order: int = 2
    support: int = 4  # tokens with non-zero probability after each context
    length: int = 64  # tokens per sequence, BOS included
    seed: int = 0  # seeds the language (part of the task)

    @property
    def vocab_size(self) -> int:
        return self.vocab

    @property
    def n_contexts(self) -> int:
        return self.vocab ** self.order

    @cached_property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, probs), each (V^order, support): the support of every context and its Dirichlet(1) weights."""
        g = torch.Generator().manual_seed(self.seed)
        tokens = torch.rand(self.n_contexts, self.vocab - 1, generator=g).argsort(1)[:, :self.support] + 1
        e = -torch.log(torch.rand(self.n_contexts, self.support, generator=g).clamp_min(1e-12))  # Exp(1)
        return tokens, e / e.sum(1, keepdim=True)

    def context(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """Context id of predicting x[:, t] (n,): Σ_j x[:, t−1−j] V^j, positions before 0 read as 0."""
        c = torch.zeros(len(x), dtype=torch.long)
        for j in range(self.order):
            if t - 1 - j >= 0:
                c += x[:, t - 1 - j] * self.vocab ** j
        return c

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """`input_ids` (n, length) starting with BOS = 0, and `labels` (= input_ids; the model shifts them)."""
        tokens, probs = self.tables
        cum = probs.cumsum(1)
        x = torch.zeros(n, self.length, dtype=torch.long)
        u = torch.rand(n, self.length, generator=generator)
        for t in range(1, self.length):
            c = self.context(x, t)
            pick = (u[:, t:t + 1] > cum[c]).sum(1).clamp_max(self.support - 1)
            x[:, t] = tokens[c, pick]
        labels = x.clone()
        labels[:, 0] = -100
        return {"input_ids": x, "labels": labels}

    def true_nll(self, x: torch.Tensor) -> torch.Tensor:
        """−log p(x_t | context) of positions 1..T−1 (n, T−1) under the true language (inf if impossible)."""
        tokens, probs = self.tables
        out = []
        for t in range(1, x.shape[1]):
            c = self.context(x, t)
            p = (probs[c] * (tokens[c] == x[:, t:t + 1])).sum(1)
            out.append(-torch.log(p))
        return torch.stack(out, 1)

    def entropy(self) -> float:
        """Mean conditional entropy over contexts (nats), uniformly weighted — a rough guide to H*."""
        _, probs = self.tables
        return float(-(probs * probs.log()).sum(1).mean())
