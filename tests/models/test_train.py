import math

import pytest
import torch

from lab.data import KVRecall
from lab.models import TrainConfig, fit, tiny_llama, train
from lab.models.train import cache_key, lr_lambda

TASK = KVRecall(n_pairs=2, n_keys=4, n_values=4, n_queries=2)


def build():
    return tiny_llama(vocab_size=len(TASK.tokenizer), d_model=16, n_layers=1, n_heads=2, max_len=16)


CFG = TrainConfig(steps=30, batch_size=8, lr=1e-2, seed=3)


def test_schedule_warms_up_then_decays_to_the_floor():
    f = lr_lambda(TrainConfig(steps=100, warmup_frac=0.1, min_lr_frac=0.1))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 99))


def test_training_lowers_the_loss():
    torch.manual_seed(0)
    losses = train(build(), TASK, TrainConfig(steps=60, batch_size=16, lr=1e-2), quiet=True)
    assert len(losses) == 60 and sum(losses[-10:]) < sum(losses[:10])


def test_stop_loss_ends_training_once_the_recent_mean_is_below_it_and_joins_the_key():
    """The rule by hand on the returned losses: the last 25-step window is the first one below the threshold."""
    torch.manual_seed(0)
    full = train(build(), TASK, TrainConfig(steps=120, batch_size=16, lr=1e-2), quiet=True)
    stop = sorted(full)[len(full) // 2] + 1e-9  # a threshold the run crosses part-way
    torch.manual_seed(0)
    cut = train(build(), TASK, TrainConfig(steps=120, batch_size=16, lr=1e-2, stop_loss=stop), quiet=True)
    first = next(n for n in range(25, 121) if sum(full[n - 25:n]) / 25 < stop)
    assert cut == full[:first] and first < 120
    m = build()
    assert cache_key(m, TASK, CFG) != cache_key(m, TASK, TrainConfig(**{**vars(CFG), "stop_loss": 0.1}))


def test_cache_round_trip_is_exact_and_keyed(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE", str(tmp_path))
    first = fit(build, TASK, CFG, quiet=True)
    second = fit(build, TASK, CFG, quiet=True)
    assert not first.cached and second.cached and first.key == second.key
    assert second.losses == first.losses
    for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values()):
        assert torch.equal(a, b)
    # anything that changes the weights changes the key
    m = build()
    keys = {cache_key(m, TASK, CFG), cache_key(m, TASK, TrainConfig(steps=31, batch_size=8, lr=1e-2, seed=3)),
            cache_key(m, TASK, TrainConfig(steps=30, batch_size=8, lr=1e-2, seed=4)),
            cache_key(m, KVRecall(n_pairs=3, n_keys=4, n_values=4, n_queries=2), CFG),
            cache_key(tiny_llama(vocab_size=len(TASK.tokenizer), d_model=32, n_layers=1, n_heads=2, max_len=16),
                      TASK, CFG)}
    assert len(keys) == 5


def test_same_seed_same_weights_without_cache():
    a, b = fit(build, TASK, CFG, cache=False, quiet=True), fit(build, TASK, CFG, cache=False, quiet=True)
    assert a.losses == b.losses


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta"])
def test_corrupt_entry_is_logged_and_rebuilt(damage, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LAB_CACHE", str(tmp_path))
    first = fit(build, TASK, CFG, quiet=True)
    entry = tmp_path / "models" / first.key
    weights = entry / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
    else:
        (entry / "meta.json").write_text("{not json")
    again = fit(build, TASK, CFG, quiet=True)
    assert not again.cached and "corrupt" in caplog.text
    assert again.losses == first.losses
    assert fit(build, TASK, CFG, quiet=True).cached  # rebuilt entry is good


def test_fit_needs_a_dataclass_task():
    class NotADataclass:
        def batch(self, n, g):
            return TASK.batch(n, g)

    with pytest.raises(TypeError, match="dataclass"):
        fit(build, NotADataclass(), CFG, quiet=True)


def test_penalty_joins_the_loss_and_the_cache_key(tmp_path, monkeypatch):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Shrink:
        lam: float

        def __call__(self, model):
            return self.lam * sum(p.pow(2).sum() for p in model.parameters())

    monkeypatch.setenv("LAB_CACHE", str(tmp_path))
    plain = fit(build, TASK, CFG, quiet=True)
    shrunk = fit(build, TASK, CFG, penalty=Shrink(1.0), quiet=True)
    assert plain.key != shrunk.key != fit(build, TASK, CFG, penalty=Shrink(2.0), quiet=True).key
    norm = lambda m: sum(p.pow(2).sum() for p in m.parameters()).item()
    assert norm(shrunk.model) < 0.5 * norm(plain.model)
    assert fit(build, TASK, CFG, penalty=Shrink(1.0), quiet=True).cached


def test_a_penalty_with_prox_gets_a_proximal_step_after_every_optimizer_step():
    calls = []

    class Prox:
        def __call__(self, model):
            return torch.zeros(())

        def prox(self, model, lr, step):
            calls.append((step, lr))

    torch.manual_seed(0)
    train(build(), TASK, CFG, penalty=Prox(), quiet=True)
    f = lr_lambda(CFG)
    assert [s for s, _ in calls] == list(range(CFG.steps))
    assert [lr for _, lr in calls] == pytest.approx([CFG.lr * f(s) for s in range(CFG.steps)])
