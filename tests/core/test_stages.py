"""The stage cache: a hit returns what computing returns and leaves every random state where computing leaves it;
any change of an argument, a random state or the library's source is a miss."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from lab.core import stages


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("LAB_STAGE_CACHE", raising=False)
    stages.configure(True)


calls: list[int] = []


@dataclass(frozen=True)
class Cfg:
    width: int
    lr: float


@dataclass
class Holder:
    generator: torch.Generator


@stages.stage
def noisy_sum(model: torch.nn.Module, x: torch.Tensor, cfg: Cfg, *, generator: torch.Generator,
              inner: Holder) -> dict:
    """Draws from the generators (one an argument, one inside one) and from every global random source, so a hit
    must restore them all."""
    calls.append(1)
    with torch.no_grad():
        y = model(x) + torch.rand(x.shape[0], 1, generator=generator) + torch.rand(1, generator=inner.generator)
        y = y + torch.rand(1)
    return {"y": y, "np": np.random.rand(), "py": random.random(), "w": cfg.width * cfg.lr}


def pipeline(model, x, cfg, seed=0):
    """A stage followed by more draws: what runs after a hit must see the same random states."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    g, h = torch.Generator().manual_seed(seed), Holder(torch.Generator().manual_seed(seed + 100))
    out = noisy_sum(model, x, cfg, generator=g, inner=h)
    return out, torch.rand(2, generator=g), torch.rand(2, generator=h.generator), torch.rand(2), np.random.rand(), \
        random.random()


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(u, v) for u, v in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def setup_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 1), torch.randn(4, 3)


def test_a_hit_is_bit_identical_to_computing_and_restores_every_random_state():
    model, x = setup_model()
    calls.clear()
    first = pipeline(model, x, Cfg(2, 0.5))
    second = pipeline(model, x, Cfg(2, 0.5))
    assert len(calls) == 1 and stages.hits()[-1].endswith("noisy_sum")
    assert same(first, second)
    stages.configure(False)  # computed again, with no cache at all: the same numbers
    assert same(first, pipeline(model, x, Cfg(2, 0.5))) and len(calls) == 2


@pytest.mark.parametrize("change", ["weights", "input", "config", "seed", "source"])
def test_any_change_is_a_miss(change, monkeypatch):
    model, x = setup_model()
    calls.clear()
    base = pipeline(model, x, Cfg(2, 0.5))
    cfg, seed = Cfg(2, 0.5), 0
    if change == "weights":
        with torch.no_grad():
            model.weight[0, 0] += 0.1
    elif change == "input":
        x = x.clone()
        x[0, 0] += 0.1
    elif change == "config":
        cfg = Cfg(2, 0.25)
    elif change == "seed":
        seed = 1
    else:
        monkeypatch.setattr(stages, "_digest", ["edited"])
    again = pipeline(model, x, cfg, seed)
    assert len(calls) == 2, f"a changed {change} must recompute"
    if change in ("weights", "input", "seed"):
        assert not same(base[0]["y"], again[0]["y"])


def test_key_of_hashes_by_value_and_refuses_identity_only_objects():
    t = torch.arange(6.0).reshape(2, 3)
    assert stages.key_of({"a": t, "b": [1, 2.0]}) == stages.key_of({"b": [1, 2.0], "a": t.clone()})
    assert stages.key_of(t) != stages.key_of(t.reshape(3, 2))  # same bytes, other shape
    assert stages.key_of(t) != stages.key_of(t.double())
    from lab.models.train import TrainResult

    model = torch.nn.Linear(2, 2)
    trained, loaded = TrainResult(model, [1.0], False, "k", 3.0), TrainResult(model, [], True, "k", 0.0)
    assert stages.key_of(trained) == stages.key_of(loaded)  # by the weights, not by how they were obtained
    many = [Cfg(i, 0.5) for i in range(50)]  # temporaries made while hashing must not be mistaken for cycles
    assert stages.key_of(many) != stages.key_of([*many[:-1], Cfg(99, 0.5)])
    assert stages.key_of(torch.tensor([True, False])) != stages.key_of(torch.tensor([False, True]))
    assert stages.key_of(lambda: t) != stages.key_of((lambda u: lambda: u)(t + 1))  # closures by what they hold
    with pytest.raises(TypeError, match="cannot key an argument of type"):
        stages.key_of(iter([1]))


def test_an_unreadable_entry_is_rebuilt(tmp_path):
    model, x = setup_model()
    calls.clear()
    first = pipeline(model, x, Cfg(2, 0.5))
    for entry in (tmp_path / "stages").rglob("*.pt"):
        entry.write_bytes(b"truncated")
    assert same(first, pipeline(model, x, Cfg(2, 0.5))) and len(calls) == 2


def test_the_environment_variable_turns_it_off(monkeypatch):
    model, x = setup_model()
    monkeypatch.setenv("LAB_STAGE_CACHE", "0")
    calls.clear()
    for _ in range(2):
        pipeline(model, x, Cfg(2, 0.5))
    assert len(calls) == 2
