"""Two procedural "languages" over one vocabulary, for learning a new language without forgetting the old.

Id 0 is <bos>. Language A ("English", the original domain) uses the ids `1 .. a_hi`; language B ("French", the
new one) uses `b_lo .. vocab − 1`, so the ids `b_lo .. a_hi` are shared with different statistics and the rest
of B is new. Each language is a sparse first-order Markov chain: every word of the language has `branch`
successors (drawn from the language's words) with Zipfian probabilities ∝ 1/rank^`zipf`, and the first word
follows a Zipfian marginal. A′ ("Wikipedia", the approximation of the original data used for replay) has A's
grammar with other topics: the start distribution re-drawn (another Zipfian order of the words) and a fraction
`shift` of the transition rows re-drawn (0 by default: re-drawn rows teach wrong transitions that a replay then
"forgets" A with, whatever the method). `entropy_rate` gives each source's exact entropy per token
(the floor of a model's cross-entropy on the tokens after the first word).

`mix(n, p, g)` is the adaptation batch: each sequence is A′ with probability p, else B, with a per-token mask
of the original-domain (A′) tokens. `batch(n, g)` is the backbone's pre-training batch (A with a share `pre_b`
of B, as an English LM has seen a little French; the `Task` protocol of `lab.models.train`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

DOMAINS = ("A", "A'", "B")


@dataclass(frozen=True)
class TwoLanguages:
    """Language A on ids 1..a_hi, language B on b_lo..vocab−1 (shared ids b_lo..a_hi); fields are the spec."""

    vocab: int = 128
    a_hi: int = 79
    b_lo: int = 48
    branch: int = 3  # successors per word
    zipf: float = 1.0  # successor probabilities ∝ 1 / rank^zipf
    shift: float = 0.0  # share of A's transition rows re-drawn in A′ (its start distribution is always re-drawn)
    seq_len: int = 32  # tokens per sequence, <bos> included
    pre_b: float = 0.02  # share of B sequences in the backbone's pre-training (an English LM saw a little French)
    seed: int = 0  # seeds the chains (part of the task)

    def words(self, domain: str) -> torch.Tensor:
        """The ids a language uses."""
        return torch.arange(1, self.a_hi + 1) if domain in ("A", "A'") else torch.arange(self.b_lo, self.vocab)

    @cached_property
    def chains(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """{domain: (successors (vocab, branch) ids, their probabilities (branch,), start distribution (vocab,))};
        rows of ids outside the language are unused (0)."""
        g = torch.Generator().manual_seed(self.seed)
        probs = torch.arange(1, self.branch + 1, dtype=torch.float64) ** -self.zipf
        probs = probs / probs.sum()

        def successors(words, rows):
            succ = torch.zeros(self.vocab, self.branch, dtype=torch.long)
            for w in rows.tolist():
                succ[w] = words[torch.randperm(len(words), generator=g)[: self.branch]]
            return succ

        out = {}
        for d in ("A", "B"):
            words = self.words(d)
            succ = successors(words, words)
            start = torch.zeros(self.vocab, dtype=torch.float64)
            start[words[torch.randperm(len(words), generator=g)]] = (
                torch.arange(1, len(words) + 1, dtype=torch.float64) ** -self.zipf)
            out[d] = (succ, probs, start / start.sum())
        words = self.words("A")
        moved = words[torch.rand(len(words), generator=g) < self.shift]
        succ = out["A"][0].clone()
        succ[moved] = successors(words, moved)[moved]
        start = torch.zeros(self.vocab, dtype=torch.float64)
        start[words[torch.randperm(len(words), generator=g)]] = (
            torch.arange(1, len(words) + 1, dtype=torch.float64) ** -self.zipf)
        out["A'"] = (succ, probs, start / start.sum())
        return out

    def transition(self, domain: str) -> torch.Tensor:
        """The transition matrix (vocab, vocab) of `domain` (float64; rows off the language are 0)."""
        succ, probs, _ = self.chains[domain]
        T = torch.zeros(self.vocab, self.vocab, dtype=torch.float64)
        rows = self.words(domain)
        T[rows[:, None], succ[rows]] = probs
        return T

    def sample(self, n: int, domain: str, generator: torch.Generator) -> torch.Tensor:
        """(n, seq_len) ids of `domain` ("A" | "A'" | "B"), <bos> first."""
        if domain not in DOMAINS:
            raise ValueError(f"domain={domain!r} is unknown; use one of {DOMAINS}.")
        succ, probs, start = self.chains[domain]
        ids = torch.zeros(n, self.seq_len, dtype=torch.long)
        ids[:, 1] = torch.multinomial(start.float(), n, replacement=True, generator=generator)
        pick = torch.multinomial(probs.float(), n * self.seq_len, replacement=True, generator=generator)
        pick = pick.view(n, self.seq_len)
        for t in range(2, self.seq_len):
            ids[:, t] = succ[ids[:, t - 1], pick[:, t]]
        return ids

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Pre-training batch: language A, each sequence B instead with probability `pre_b`; LM loss on every token."""
        ids = self.mix(n, 1.0 - self.pre_b, generator, original="A")["input_ids"]
        return {"input_ids": ids, "labels": ids.clone()}

    def mix(self, n: int, p: float, generator: torch.Generator, *, original: str = "A'") -> dict[str, torch.Tensor]:
        """Adaptation batch: each sequence is `original` (A′) with probability p, else B. `orig` (n, seq_len) bool
        marks the original-domain tokens (whole sequences here; the loss code treats it per token)."""
        is_orig = torch.rand(n, generator=generator) < p
        k = int(is_orig.sum())
        ids = torch.empty(n, self.seq_len, dtype=torch.long)
        if k:
            ids[is_orig] = self.sample(k, original, generator)
        if k < n:
            ids[~is_orig] = self.sample(n - k, "B", generator)
        return {"input_ids": ids, "labels": ids.clone(), "orig": is_orig[:, None].expand(n, self.seq_len).clone()}

    def mixed_sequence(self, generator: torch.Generator, cut: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence that switches language: A up to `cut` (default half), then B continuing from a B word.
        Returns ids (seq_len,) and the language of each token (0 = A, 1 = B; <bos> counts as A)."""
        cut = cut or self.seq_len // 2
        a, b = self.sample(1, "A", generator)[0], self.sample(1, "B", generator)[0]
        ids = torch.cat([a[:cut], b[1: self.seq_len - cut + 1]])
        return ids, (torch.arange(self.seq_len) >= cut).long()

    def entropy_rate(self, domain: str) -> float:
        """Exact mean entropy (nats) of the next word given the previous one over the positions 2 .. seq_len − 1
        of a sequence (the word distribution at each position propagated from the start distribution): the
        cross-entropy floor of a perfect model of `domain` on the tokens after the first word."""
        T, pi = self.transition(domain), self.chains[domain][2]
        h = -(T * torch.where(T > 0, T.log(), torch.zeros_like(T))).sum(1)
        total = 0.0
        for _ in range(2, self.seq_len):
            total += float(pi @ h)
            pi = pi @ T
        return total / (self.seq_len - 2)
