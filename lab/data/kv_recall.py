"""In-context key-value recall: the model reads key-value pairs, then a queried key, and must
output that key's value. A two-layer attention model solves it with an induction-style lookup
(find the queried key earlier in the context, copy the token after it); chance is 1/n_values.

    k3 v7 k1 v2 k9 v0 k5 v5 ? k1 -> v2
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from lab.models.tokenizer import SPECIALS, word_tokenizer

QUERY = "?"
IGNORE = -100  # label of positions without loss


@dataclass(frozen=True)
class KVRecall:
    """A seeded generator of recall sequences; its fields are its spec (they key the model cache)."""

    n_pairs: int = 4  # key-value pairs in the context (keys distinct)
    n_keys: int = 16
    n_values: int = 16
    n_queries: int = 1  # queries per training sequence; each scores only its value

    def __post_init__(self):
        if not 1 <= self.n_pairs <= self.n_keys:
            raise ValueError(f"n_pairs={self.n_pairs} must be between 1 and n_keys={self.n_keys}.")
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
        return self.keys + self.values + [QUERY]

    @cached_property
    def tokenizer(self):
        """Word-level tokenizer whose ids agree with `batch`: specials, then keys, values, '?'."""
        return word_tokenizer(self.words)

    @property
    def seq_len(self) -> int:
        return 2 * self.n_pairs + 3 * self.n_queries

    def sample(self, n: int, generator: torch.Generator, n_queries: int | None = None):
        """Key, value and query indices: `k` (n, P), `v` (n, P), `q` (n, Q) positions into the pairs."""
        k = torch.rand(n, self.n_keys, generator=generator).argsort(-1)[:, : self.n_pairs]  # (n, P)
        v = torch.randint(self.n_values, (n, self.n_pairs), generator=generator)  # (n, P)
        q = torch.randint(self.n_pairs, (n, n_queries or self.n_queries), generator=generator)  # (n, Q)
        return k, v, q

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Token ids `input_ids` (n, T) and `labels` (n, T), loss only on the queried values."""
        k, v, q = self.sample(n, generator)
        key_id, val_id = len(SPECIALS) + k, len(SPECIALS) + self.n_keys + v
        query_id = len(SPECIALS) + self.n_keys + self.n_values
        ctx = torch.stack([key_id, val_id], -1).flatten(1)  # (n, 2P): k v k v ...
        qk, qv = key_id.gather(1, q), val_id.gather(1, q)  # (n, Q)
        tail = torch.stack([torch.full_like(qk, query_id), qk, qv], -1).flatten(1)  # (n, 3Q): ? k v ...
        input_ids = torch.cat([ctx, tail], 1)  # (n, T)
        labels = torch.full_like(input_ids, IGNORE)
        labels[:, 2 * self.n_pairs + 2::3] = input_ids[:, 2 * self.n_pairs + 2::3]  # the queried values
        return {"input_ids": input_ids, "labels": labels}

    def examples(self, n: int, generator: torch.Generator) -> list[dict]:
        """`n` evaluation prompts as text, each ending at its queried key, with the answer and the
        character span `(start, end)` of the answer's occurrence in the context."""
        k, v, q = self.sample(n, generator, n_queries=1)
        out = []
        for ki, vi, (qi,) in zip(k.tolist(), v.tolist(), q.tolist()):
            pairs = [f"k{a} v{b}" for a, b in zip(ki, vi)]
            start = sum(len(p) + 1 for p in pairs[:qi]) + len(f"k{ki[qi]} ")  # char offset of the answer
            answer = f"v{vi[qi]}"
            out.append({"prompt": f"{' '.join(pairs)} {QUERY} k{ki[qi]}", "answer": answer,
                        "answer_span": (start, start + len(answer))})
        return out
