import copy
import math

import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM

from lab.interp import gather_aggregate as ga
from lab.models import tiny_llama, tiny_mamba2, tiny_mixtral

V = 20


def models():
    torch.manual_seed(0)
    mamba1 = MambaForCausalLM(MambaConfig(vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=2,
                                          expand=2, use_mambapy=False))
    return {"llama": tiny_llama(vocab_size=V, d_model=32, n_layers=2, n_heads=4),
            "mixtral": tiny_mixtral(vocab_size=V, d_model=32, n_layers=2, n_heads=4),
            "mamba2": tiny_mamba2(vocab_size=V, d_model=32, n_layers=2, head_dim=16),
            "mamba1": mamba1}


MODELS = models()
X = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))


def logits(model):
    with torch.no_grad():
        return model(input_ids=X, use_cache=False).logits


def manual_zero_head(model, layer, heads):
    """Zero the heads' slices of the output projection's *input* with a hook: the reference."""
    H, d_head = ga.head_shape(model, layer)

    def hook(_, args):
        (x,) = args
        x = x.clone().view(*x.shape[:-1], H, d_head)
        x[..., heads, :] = 0
        return (x.view(*x.shape[:-2], H * d_head),)

    return ga.out_proj(model, layer).register_forward_pre_hook(hook)


@pytest.mark.parametrize("name", list(MODELS))
def test_head_shapes(name):
    m = MODELS[name]
    H, d_head = ga.head_shape(m, 0)
    assert H * d_head == ga.out_proj(m, 0).in_features
    assert {"llama": (4, 8), "mixtral": (4, 8), "mamba2": (4, 16), "mamba1": (32, 1)}[name] == (H, d_head)


@pytest.mark.parametrize("name", list(MODELS))
def test_ablation_equals_zeroing_the_heads_output(name):
    m = MODELS[name].eval()
    heads = [1, 2]
    handle = manual_zero_head(m, 1, heads)
    want = logits(m)
    handle.remove()
    with ga.ablate(m, {1: heads}):
        got = logits(m)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, logits(m))  # and it did change something


@pytest.mark.parametrize("name", list(MODELS))
def test_keep_and_remove_are_complements_and_restore_exactly(name):
    m = MODELS[name]
    W0 = {l: ga.out_proj(m, l).weight.detach().clone() for l in (0, 1)}
    heads = {0: [0], 1: [1, 3]}
    with ga.ablate(m, heads):
        removed = {l: ga.out_proj(m, l).weight.detach().clone() for l in heads}
    with ga.ablate(m, heads, keep=True):
        kept = {l: ga.out_proj(m, l).weight.detach().clone() for l in heads}
    for l in heads:
        assert torch.equal(removed[l] + kept[l], W0[l])  # complementary masks: exact inverse pair
        assert torch.equal(ga.out_proj(m, l).weight, W0[l])  # restored bit for bit
    with pytest.raises(RuntimeError), ga.ablate(m, {1: [0]}):
        raise RuntimeError("restored even on error")
    assert torch.equal(ga.out_proj(m, 1).weight, W0[1])
    with pytest.raises(IndexError):
        with ga.ablate(m, {0: [99]}):
            pass


def test_pruned_keeps_the_first_blocks_and_restores():
    m = MODELS["llama"].eval()
    full = logits(m)
    with ga.pruned(m, keep_layers=1):
        one = logits(m)
    # reference: the residual stream after the first block, then the final norm and the head
    with torch.no_grad():
        after_first = m.model(input_ids=X, output_hidden_states=True, use_cache=False).hidden_states[1]
        torch.testing.assert_close(one, m.lm_head(m.model.norm(after_first)))
    assert not torch.allclose(one, full)
    torch.testing.assert_close(logits(m), full)  # restored
    with ga.pruned(m, skip=1):  # skipping the last block is the same as keeping the first
        torch.testing.assert_close(logits(m), one)


def test_sweep_four_configurations_and_collapse_on_a_scripted_model():
    m = MODELS["llama"]
    # an "accuracy" that needs head 2 of layer 0 and head 1 of layer 1 (read off the live weights)
    def acc():
        alive = lambda l, h: ga.out_proj(m, l).weight.view(32, 4, 8)[:, h].abs().sum() > 0
        return 0.25 + 0.75 * float(alive(0, 2) and alive(1, 1))

    drop = ga.head_sweep(m, [0, 1], acc)
    assert drop.shape == (2, 4)
    assert drop.tolist() == [[0, 0, 0.75, 0], [0, 0.75, 0, 0]]
    table = ga.four_configurations(m, (0, 2), (1, 1), acc)
    assert table == {"gather + aggregate": 1.0, "only aggregate": 0.25, "only gather": 0.25, "none": 0.25}
    assert ga.collapse_layer([0.25, 0.26, 0.9, 0.95], chance=0.25) == 2
    assert ga.collapse_layer([0.2, 0.25, 0.22], chance=0.25) is None  # no retrieval anywhere
    curve = ga.pruning_curve(m, {"n_blocks": lambda: float(sum(not isinstance(b, ga._Skip) for b in ga.layers(m)))})
    assert curve == {"n_blocks": [1.0, 2.0]}


def test_attention_for_each_kind():
    for name in ("llama", "mamba2", "mamba1"):
        m = MODELS[name]
        A = ga.attention(m, X[:1], 1)
        H, _ = ga.head_shape(m, 1)
        assert A.shape == (1, H, 9, 9)
        assert torch.all(A.triu(1) == 0)
    torch.testing.assert_close(ga.attention(MODELS["llama"], X[:1], 0).sum(-1), torch.ones(1, 4, 9))


def test_sharpness_by_hand():
    mass, ent = ga.sharpness(torch.tensor([0.0, 1.0, 0.0, 0.0]), 1)
    assert mass == 1.0 and ent == pytest.approx(0.0, abs=1e-6)
    mass, ent = ga.sharpness(torch.tensor([0.5, -0.5, 0.5, 0.5]), 1)  # |.|: SSM rows can be negative
    assert mass == pytest.approx(0.25) and ent == pytest.approx(math.log(4))
    mass, _ = ga.sharpness(torch.tensor([0.1, 0.2, 0.3, 0.4]), [2, 3])  # a segment of positions
    assert mass == pytest.approx(0.7)


def test_head_lasso_is_a_sum_of_head_norms():
    m = MODELS["llama"]
    want = sum(ga.out_proj(m, l).weight.view(32, 4, 8)[:, h].norm() for l in (0, 1) for h in range(4))
    torch.testing.assert_close(ga.HeadLasso(0.5)(m), 0.5 * want)


def test_head_lasso_prox_is_group_soft_thresholding():
    m = copy.deepcopy(MODELS["llama"])
    W0 = ga.out_proj(m, 1).weight.detach().clone().view(32, 4, 8)
    norms = W0.pow(2).sum((0, 2)).sqrt()  # (4,)
    tau = float(norms.sort().values[1] + norms.sort().values[2]) / 2  # two heads below, two above
    lasso = ga.HeadLasso(lam=2.0, start=3)
    lasso.prox(m, tau / 2.0, step=2)  # before `start`: nothing happens
    assert torch.equal(ga.out_proj(m, 1).weight.view(32, 4, 8), W0)
    lasso.prox(m, tau / 2.0, step=3)
    W = ga.out_proj(m, 1).weight.view(32, 4, 8)
    for h in range(4):  # by hand: zero below the threshold, else shrunk by tau along its direction
        want = torch.zeros_like(W0[:, h]) if norms[h] <= tau else W0[:, h] * (1 - tau / norms[h])
        torch.testing.assert_close(W[:, h], want)
    assert (ga.head_norms(m, 1) == 0).sum() == 2


def test_accuracy_shared_and_per_example_choices():
    from lab.models import word_tokenizer

    tok = word_tokenizer(["a", "b", "c", "x"])
    torch.manual_seed(0)
    m = tiny_llama(vocab_size=len(tok), d_model=16, n_layers=1, n_heads=2).eval()
    ex = [{"prompt": "x a", "answer": "b"}, {"prompt": "x b", "answer": "c"}, {"prompt": "x c", "answer": "a"}]
    from lab.models.score import choice_logprobs

    logp = choice_logprobs(m, tok, [e["prompt"] for e in ex], ["a", "b", "c"])
    want = sum(["abc"[i] == e["answer"] for i, e in zip(logp.argmax(1).tolist(), ex)]) / 3
    assert ga.accuracy(m, tok, ex, ["a", "b", "c"]) == want
    assert ga.accuracy(m, tok, [{**e, "choices": ["a", "b", "c"]} for e in ex]) == want


def test_discover_on_a_scripted_model():
    m = MODELS["llama"]

    def alive(l, h):
        return ga.out_proj(m, l).weight.view(32, 4, 8)[:, h].abs().sum() > 0

    letter = lambda: 0.25 + 0.75 * float(alive(0, 3) and alive(1, 0)) - 0.05 * float(not alive(1, 2))
    cloze = lambda: 1.0
    d = ga.discover(m, letter, cloze, (0, 1))
    assert d.gather == (0, 3) and d.aggregate == (1, 0)
    assert d.letter == 1.0 and d.removed == {"gather": (0.25, 1.0), "aggregate": (0.25, 1.0)}
    assert d.other_max == pytest.approx(0.05)
    assert d.table["gather + aggregate"] == pytest.approx(0.95) and d.table["none"] == pytest.approx(0.2)
    assert ga.discover(m, letter, cloze, (0, 1), heads=((0, 1), (1, 1))).gather == (0, 1)


def test_paper_heads_by_hub_id_or_folder_name():
    want = ((16, 22), (17, 24))
    assert ga.paper_heads("meta-llama/Llama-3.1-8B-Instruct") == want
    assert ga.paper_heads("/models/llama-3.1-8b-instruct/") == want
    assert ga.paper_heads("/tmp/some-tiny-model") is None


def test_all_heads_silences_the_layer_and_random_heads_draws_a_seeded_set_of_that_size():
    m = MODELS["mamba2"].eval()
    H, _ = ga.head_shape(m, 1)
    assert ga.all_heads(m, 1) == {1: list(range(H))}
    with ga.ablate(m, ga.all_heads(m, 1)):
        assert ga.out_proj(m, 1).weight.abs().sum() == 0
    draws = [ga.random_heads(m, (0, 1), H, torch.Generator().manual_seed(s)) for s in range(20)]
    assert all(sum(map(len, d.values())) == H for d in draws)  # as many heads as the layer it stands in for
    assert all(len(set(hs)) == len(hs) and set(hs) <= set(range(H)) for d in draws for hs in d.values())
    assert draws[0] == ga.random_heads(m, (0, 1), H, torch.Generator().manual_seed(0))
    assert any(0 in d for d in draws) and any(d != {1: list(range(H))} for d in draws)  # not targeted at layer 1
    with pytest.raises(ValueError):
        ga.random_heads(m, (0, 1), 2 * H + 1, torch.Generator())


def test_decoy_positions_are_other_delimiters():
    D = 9
    ids = torch.tensor([[0, 5, 6, D, 5, 6, D, 5, 6, D, 3]] * 50)
    target = torch.tensor([3, 6, 9, 3, 6] * 10)
    decoy = ga.decoy_positions(ids, target, D, torch.Generator().manual_seed(0))
    assert torch.all(ids[torch.arange(50), decoy] == D) and torch.all(decoy != target)
    assert set(decoy.tolist()) == {3, 6, 9}  # every wrong option gets drawn
    with pytest.raises(ValueError):
        ga.decoy_positions(ids[:1, :4], torch.tensor([3]), D, torch.Generator())


def test_the_notebook_declares_the_documented_controls():
    from pathlib import Path

    from lab.cli import declared_controls

    nb = Path(__file__).resolve().parents[2] / "notebooks" / "09_gather_aggregate.ipynb"
    assert set(declared_controls(nb)) == set(ga.CONTROLS) == {"random_heads", "shuffled", "untrained"}
