"""In-context key-value recall: the model reads key-value pairs, then a queried key, and must
output that key's value. A two-layer attention model solves it with an induction-style lookup
(find the queried key earlier in the context, copy the token after it); chance is 1/n_values.

    k3 v7 k1 v2 k9 v0 k5 v5 ? k1 -> v2

With `min_pairs` set, each sequence holds a random number of real pairs in [min_pairs, n_pairs];
filler pairs `_ _` fill the front so every sequence has the same length (no padding masks), and
`examples(..., n_pairs=k)` evaluates at exactly k pairs (retrieval vs. number of pairs).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from lab.models.tokenizer import SPECIALS, word_tokenizer

QUERY, FILL = "?", "_"
IGNORE = -100  # label of positions without loss


@dataclass(frozen=True)
class KVRecall:
    """A seeded generator of recall sequences; its fields are its spec (they key the model cache)."""

    n_pairs: int = 4  # key-value pairs in the context (keys distinct)
    n_keys: int = 16
    n_values: int = 16
    n_queries: int = 1  # queries per training sequence; each scores only its value
    min_pairs: int | None = None  # if set, real pairs per sequence vary in [min_pairs, n_pairs]

    def __post_init__(self):
        if not 1 <= self.n_pairs <= self.n_keys:
            raise ValueError(f"n_pairs={self.n_pairs} must be between 1 and n_keys={self.n_keys}.")
        if self.min_pairs is not None and not 1 <= self.min_pairs <= self.n_pairs:
            raise ValueError(f"min_pairs={self.min_pairs} must be between 1 and n_pairs={self.n_pairs}.")
        if self.n_values < 2 or self.n_queries < 1:
            raise ValueError("n_values must be >= 2 and n_queries >= 1.")

    @property
    def keys(self) -> list[str]:
        return [f"k{i}" for i in range(self.n_keys)]

    @property
    def values(self) -> list[str]:
        return [f"v{i}" for i in range(self.n_values)]

    @property
    def words(self) -> list[str]:
        return self.keys + self.values + [QUERY] + ([FILL] if self.min_pairs is not None else [])

    @cached_property
    def tokenizer(self):
        """Word-level tokenizer whose ids agree with `batch`: specials, then keys, values, '?'."""
        return word_tokenizer(self.words)

    @property
    def seq_len(self) -> int:
        return 2 * self.n_pairs + 3 * self.n_queries

    def sample(self, n: int, generator: torch.Generator, n_queries: int | None = None, n_pairs: int | None = None):
        """Key, value and query indices: `k` (n, P), `v` (n, P), `q` (n, Q) positions into the pairs,
        and `real` (n,), the number of real pairs (the first P - real slots are filler)."""
        P = self.n_pairs
        k = torch.rand(n, self.n_keys, generator=generator).argsort(-1)[:, :P]  # (n, P)
        v = torch.randint(self.n_values, (n, P), generator=generator)  # (n, P)
        if n_pairs is not None:
            real = torch.full((n,), n_pairs)
        elif self.min_pairs is not None:
            real = torch.randint(self.min_pairs, P + 1, (n,), generator=generator)
        else:
            real = torch.full((n,), P)
        u = torch.rand(n, n_queries or self.n_queries, generator=generator)  # (n, Q)
        q = P - real[:, None] + (u * real[:, None]).long()  # (n, Q): among the real pairs
        return k, v, q, real

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Token ids `input_ids` (n, T) and `labels` (n, T), loss only on the queried values."""
        k, v, q, real = self.sample(n, generator)
        key_id, val_id = len(SPECIALS) + k, len(SPECIALS) + self.n_keys + v
        query_id = len(SPECIALS) + self.n_keys + self.n_values
        ctx = torch.stack([key_id, val_id], -1).flatten(1)  # (n, 2P): k v k v ...
        filler = torch.arange(2 * self.n_pairs)[None, :] < 2 * (self.n_pairs - real[:, None])  # (n, 2P)
        ctx = ctx.masked_fill(filler, query_id + 1)  # '_' pairs in front
        qk, qv = key_id.gather(1, q), val_id.gather(1, q)  # (n, Q)
        tail = torch.stack([torch.full_like(qk, query_id), qk, qv], -1).flatten(1)  # (n, 3Q): ? k v ...
        input_ids = torch.cat([ctx, tail], 1)  # (n, T)
        labels = torch.full_like(input_ids, IGNORE)
        labels[:, 2 * self.n_pairs + 2::3] = input_ids[:, 2 * self.n_pairs + 2::3]  # the queried values
        return {"input_ids": input_ids, "labels": labels}

    def examples(self, n: int, generator: torch.Generator, n_pairs: int | None = None) -> list[dict]:
        """`n` evaluation prompts as text, each ending at its queried key, with the answer and the
        character span `(start, end)` of the answer's occurrence in the context. `n_pairs` fixes
        the number of real pairs (tasks with `min_pairs`)."""
        k, v, q, real = self.sample(n, generator, n_queries=1, n_pairs=n_pairs)
        out = []
        for ki, vi, (qi,), r in zip(k.tolist(), v.tolist(), q.tolist(), real.tolist()):
            pairs = [f"{FILL} {FILL}"] * (self.n_pairs - r) + [f"k{a} v{b}" for a, b in zip(ki, vi)][self.n_pairs - r:]
            start = sum(len(p) + 1 for p in pairs[:qi]) + len(f"k{ki[qi]} ")  # char offset of the answer
            answer = f"v{vi[qi]}"
            out.append({"prompt": f"{' '.join(pairs)} {QUERY} k{ki[qi]}", "answer": answer,
                        "answer_span": (start, start + len(answer))})
        return out
