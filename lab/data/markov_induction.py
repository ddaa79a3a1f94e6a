"""Markov text with induction segments: a toy language whose MLPs and attention heads both matter (Olica toy).

Two sources are mixed in every sequence (He & Lin, ICML 2025, prune both the FFN and the attention of an LLM, so
the toy must need both):

- a sparse **2nd-order Markov** source: the pair (x_{t-2}, x_{t-1}) is hashed to one of `n_states` states, each with
  `n_next` successors drawn from a Zipfian marginal with random (Dirichlet) weights; memorising the table is the
  MLPs' job;
- **induction segments**: with probability `p_copy` a span of `min_span`–`max_span` tokens that already occurred is
  repeated later in the sequence; predicting the copy needs attention (previous-token + induction heads).

Id 0 is reserved (never emitted). `labels` equal `input_ids` (the model shifts them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class MarkovInduction:
    vocab_size: int = 128
    length: int = 64
    n_states: int = 256  # hashed 2nd-order contexts
    n_next: int = 4  # successors per context
    zipf: float = 1.1  # exponent of the successors' marginal
    p_copy: float = 0.7  # probability that a sequence holds one induction segment
    min_span: int = 8
    max_span: int = 16
    seed: int = 0  # seeds the Markov table (part of the task)

    @cached_property
    def table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hash (V, V) -> state, successors (n_states, n_next), probabilities (n_states, n_next))."""
        g = torch.Generator().manual_seed(self.seed)
        V = self.vocab_size
        state = torch.randint(self.n_states, (V, V), generator=g)
        marginal = torch.arange(1, V, dtype=torch.float).pow(-self.zipf)[torch.randperm(V - 1, generator=g)]
        nxt = torch.multinomial(marginal.expand(self.n_states, -1), self.n_next, generator=g) + 1  # ids 1..V-1
        probs = -torch.rand(self.n_states, self.n_next, generator=g).log()  # Exp(1) -> Dirichlet(1) rows
        return state, nxt, probs / probs.sum(-1, keepdim=True)

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """`input_ids` (n, length) and `labels` (= input_ids)."""
        state, nxt, probs = self.table
        T = self.length
        x = torch.empty(n, T, dtype=torch.long)
        x[:, :2] = torch.randint(1, self.vocab_size, (n, 2), generator=generator)
        span = torch.randint(self.min_span, self.max_span + 1, (n,), generator=generator)
        copy = torch.rand(n, generator=generator) < self.p_copy
        src = torch.randint(2, T // 2 - self.max_span, (n,), generator=generator)  # span start
        dst = src + span + torch.randint(2, T // 2, (n,), generator=generator)  # repeat start (≤ T - span)
        dst = torch.minimum(dst, T - span)
        u = torch.rand(n, T, generator=generator)
        for t in range(2, T):
            s = state[x[:, t - 2], x[:, t - 1]]  # (n,)
            choice = (probs[s].cumsum(-1) < u[:, t:t + 1]).sum(-1).clamp(max=self.n_next - 1)
            markov = nxt[s, choice]
            k = t - dst
            in_copy = copy & (k >= 0) & (k < span)
            x[:, t] = torch.where(in_copy, x[torch.arange(n), (src + k).clamp(0, T - 1)], markov)
        return {"input_ids": x, "labels": x.clone()}
