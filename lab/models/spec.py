"""`TinyLM`: one tiny zoo model and its pre-training, as a field of a paper's frozen `Config`.

A paper's toy usually starts from a tiny model trained on its task. `TinyLM` holds the model's family and
sizes (`lab.models.zoo`) and the trainer's steps, batch size and lr (`lab.models.train.TrainConfig`, other
fields at their defaults); `fit` builds and trains it, or loads it from the cache under the same key as
`lab.models.train.fit(partial(zoo.build, family, ...), task, TrainConfig(...))` written out by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from lab.models import train, zoo


@dataclass(frozen=True)
class TinyLM:
    """A tiny model of a zoo family and its pre-training. Sizes left at None take the builder's default (so a
    family without heads, e.g. "mamba2", leaves `n_heads` / `max_len` / `d_ff` unset); `extra` holds
    family-specific sizes as (name, value) pairs, e.g. (("n_experts", 8),) or (("rope", False),)."""

    family: str = "llama"
    d_model: int = 64
    n_layers: int = 2
    n_heads: int | None = None
    max_len: int | None = None
    d_ff: int | None = None
    extra: tuple[tuple[str, Any], ...] = ()
    steps: int = 500
    batch_size: int = 32
    lr: float = 3e-3

    def sizes(self) -> dict[str, Any]:
        """The builder's keyword sizes (without `vocab_size`): the set ones only."""
        given = {"n_heads": self.n_heads, "max_len": self.max_len, "d_ff": self.d_ff}
        return {"d_model": self.d_model, "n_layers": self.n_layers,
                **{k: v for k, v in given.items() if v is not None}, **dict(self.extra)}

    def build(self, vocab_size: int):
        """A fresh, untrained model (`zoo.build`); seed torch before calling it for a reproducible init."""
        return zoo.build(self.family, vocab_size=vocab_size, **self.sizes())

    def train_config(self, seed: int) -> train.TrainConfig:
        """The trainer's config: these steps, batch size and lr with `seed`, every other field its default."""
        return train.TrainConfig(steps=self.steps, batch_size=self.batch_size, lr=self.lr, seed=seed)

    def fit(self, task: Any, vocab_size: int, *, seed: int, device: str = "cpu", **kw) -> train.TrainResult:
        """Build (seeded by `seed`) and train on `task`, or load from the cache (`lab.models.train.fit`; `kw`:
        its `penalty`, `cache`, `quiet`)."""
        return train.fit(partial(self.build, vocab_size), task, self.train_config(seed), device=device, **kw)
