from dataclasses import FrozenInstanceError, replace

import pytest
import torch

from lab.data import KVRecall
from lab.models import TinyLM, TrainConfig, fit, tiny_llama, tiny_mamba2, tiny_mixtral
from lab.models.train import cache_key

TASK = KVRecall(n_pairs=2, n_keys=4, n_values=4, n_queries=2)
V = len(TASK.tokenizer)
SPEC = TinyLM(d_model=16, n_layers=1, n_heads=2, max_len=16, steps=12, batch_size=8, lr=1e-2)


def by_hand():
    return tiny_llama(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=16)


def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_build_is_the_zoo_builder_with_the_sizes():
    torch.manual_seed(0)
    got = SPEC.build(V)
    torch.manual_seed(0)
    ref = by_hand()
    assert type(got) is type(ref) and got.config.to_dict() == ref.config.to_dict() and same_weights(got, ref)
    torch.manual_seed(1)
    wide = replace(SPEC, d_ff=40, extra=(("rope", False),)).build(V)
    torch.manual_seed(1)
    ref = tiny_llama(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=16, d_ff=40, rope=False)
    assert wide.config.to_dict() == ref.config.to_dict() and same_weights(wide, ref)


def test_unset_sizes_take_the_builders_defaults_and_other_families_build():
    assert TinyLM().build(V).config.to_dict() == tiny_llama(vocab_size=V).config.to_dict()
    mix = TinyLM(family="mixtral", d_model=32, n_layers=1, extra=(("n_experts", 3), ("top_k", 1)))
    assert mix.build(V).config.to_dict() == tiny_mixtral(vocab_size=V, d_model=32, n_layers=1, n_experts=3,
                                                         top_k=1).config.to_dict()
    ssm = TinyLM(family="mamba2", d_model=32, n_layers=1)
    assert ssm.build(V).config.to_dict() == tiny_mamba2(vocab_size=V, d_model=32, n_layers=1).config.to_dict()
    with pytest.raises(ValueError, match="zoo"):
        TinyLM(family="gpt").build(V)


def test_train_config_is_the_trainers_with_these_values_and_the_seed():
    assert SPEC.train_config(7) == TrainConfig(steps=12, batch_size=8, lr=1e-2, seed=7)
    assert TinyLM().train_config(0) == TrainConfig()  # the defaults agree with the trainer's
    with pytest.raises(FrozenInstanceError):
        SPEC.steps = 3


def test_fit_is_the_hand_built_fit_with_the_same_cache_key():
    got = SPEC.fit(TASK, V, seed=3, cache=False, quiet=True)
    ref = fit(by_hand, TASK, TrainConfig(steps=12, batch_size=8, lr=1e-2, seed=3), cache=False, quiet=True)
    assert got.key == ref.key and got.losses == ref.losses and same_weights(got.model, ref.model)
    torch.manual_seed(0)
    model = by_hand()
    assert got.key == cache_key(model, TASK, TrainConfig(steps=12, batch_size=8, lr=1e-2, seed=3))
    assert SPEC.fit(TASK, V, seed=4, cache=False, quiet=True).key != got.key  # the seed joins the key
