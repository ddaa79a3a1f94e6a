import copy
import math

import pytest
import torch

from lab.interp import ablation
from lab.models import hooks
from tests.interp.tiny import alive, models

MODELS = models()


def test_sweep_collapse_and_pruning_curve_on_a_scripted_model():
    m = MODELS["llama"]
    # an "accuracy" that needs head 2 of layer 0 and head 1 of layer 1 (read off the live weights)
    def acc():
        alive = lambda l, h: hooks.out_proj(m, l).weight.view(32, 4, 8)[:, h].abs().sum() > 0
        return 0.25 + 0.75 * float(alive(0, 2) and alive(1, 1))

    drop = ablation.head_sweep(m, [0, 1], acc)
    assert drop.shape == (2, 4)
    assert drop.tolist() == [[0, 0, 0.75, 0], [0, 0.75, 0, 0]]
    assert ablation.collapse_layer([0.25, 0.26, 0.9, 0.95], chance=0.25) == 2
    assert ablation.collapse_layer([0.2, 0.25, 0.22], chance=0.25) is None  # no retrieval anywhere
    n_blocks = lambda: float(sum(not isinstance(b, hooks.Skip) for b in hooks.layers(m)))
    curve = ablation.pruning_curve(m, {"n_blocks": n_blocks})
    assert curve == {"n_blocks": [1.0, 2.0]}


def test_head_lasso_is_a_sum_of_head_norms():
    m = MODELS["llama"]
    want = sum(hooks.out_proj(m, l).weight.view(32, 4, 8)[:, h].norm() for l in (0, 1) for h in range(4))
    torch.testing.assert_close(ablation.HeadLasso(0.5)(m), 0.5 * want)


def test_head_lasso_prox_is_group_soft_thresholding():
    m = copy.deepcopy(MODELS["llama"])
    W0 = hooks.out_proj(m, 1).weight.detach().clone().view(32, 4, 8)
    norms = W0.pow(2).sum((0, 2)).sqrt()  # (4,)
    tau = float(norms.sort().values[1] + norms.sort().values[2]) / 2  # two heads below, two above
    lasso = ablation.HeadLasso(lam=2.0, start=3)
    lasso.prox(m, tau / 2.0, step=2)  # before `start`: nothing happens
    assert torch.equal(hooks.out_proj(m, 1).weight.view(32, 4, 8), W0)
    lasso.prox(m, tau / 2.0, step=3)
    W = hooks.out_proj(m, 1).weight.view(32, 4, 8)
    for h in range(4):  # by hand: zero below the threshold, else shrunk by tau along its direction
        want = torch.zeros_like(W0[:, h]) if norms[h] <= tau else W0[:, h] * (1 - tau / norms[h])
        torch.testing.assert_close(W[:, h], want)
    assert (hooks.head_norms(m, 1) == 0).sum() == 2



def test_random_heads_draws_a_seeded_set_of_the_layer_size():
    m = MODELS["mamba2"].eval()
    H, _ = hooks.head_shape(m, 1)
    draws = [ablation.random_heads(m, (0, 1), H, torch.Generator().manual_seed(s)) for s in range(20)]
    assert all(sum(map(len, d.values())) == H for d in draws)  # as many heads as the layer it stands in for
    assert all(len(set(hs)) == len(hs) and set(hs) <= set(range(H)) for d in draws for hs in d.values())
    assert draws[0] == ablation.random_heads(m, (0, 1), H, torch.Generator().manual_seed(0))
    assert any(0 in d for d in draws) and any(d != {1: list(range(H))} for d in draws)  # not targeted at layer 1
    with pytest.raises(ValueError):
        ablation.random_heads(m, (0, 1), 2 * H + 1, torch.Generator())



def test_random_like_draws_the_same_shape_per_layer():
    m = MODELS["mamba2"]
    H = hooks.head_shape(m, 0)[0]
    heads = {0: [1], 1: [0, 3]}
    draws = [ablation.random_like(m, heads, torch.Generator().manual_seed(s)) for s in range(30)]
    assert all({k: len(v) for k, v in d.items()} == {0: 1, 1: 2} for d in draws)
    assert all(len(set(hs)) == len(hs) and set(hs) <= set(range(H)) for d in draws for hs in d.values())
    assert draws[0] == ablation.random_like(m, heads, torch.Generator().manual_seed(0))
    assert len({tuple(d[0]) for d in draws}) > 1  # not always the same head


def test_versus_random_against_a_naive_loop():
    m = MODELS["llama"]
    acc = lambda: 0.25 + 0.75 * float(alive(m, 0, 2) and alive(m, 1, 1))  # needs exactly G = L0H2 and A = L1H1
    heads = {0: [2], 1: [1]}
    got = ablation.versus_random(m, heads, acc, n_draws=6, seed=4)
    # by hand: draws from the same seeded generator, each draw removed then kept-only
    g = torch.Generator().manual_seed(4)
    draws = [ablation.random_like(m, heads, g) for _ in range(6)]
    hit = [float(d[0] == [2] or d[1] == [1]) for d in draws]  # a draw that removes G or A kills the task
    both = [float(d[0] == [2] and d[1] == [1]) for d in draws]  # keeping only G and A keeps it
    rand_removed = sum(1.0 - 0.75 * h for h in hit) / 6
    rand_kept = sum(0.25 + 0.75 * b for b in both) / 6
    want = {"removed": 0.25, "random removed": rand_removed, "excess drop": rand_removed - 0.25,
            "kept": 1.0, "random kept": rand_kept, "excess kept": 1.0 - rand_kept}
    assert got == pytest.approx(want)
    assert got["excess drop"] > 0 and got["excess kept"] > 0
    # the control: the heads under test are themselves the mean of further draws of the same generator
    ctl = ablation.versus_random(m, heads, acc, n_draws=6, seed=4, control=True)
    more = [ablation.random_like(m, heads, g) for _ in range(6)]
    own_removed = sum(1.0 - 0.75 * float(d[0] == [2] or d[1] == [1]) for d in more) / 6
    assert ctl["random removed"] == pytest.approx(rand_removed) and ctl["removed"] == pytest.approx(own_removed)
    assert all(alive(m, l, h) for l in (0, 1) for h in range(4))  # every weight restored
    assert set(ablation.versus_random(m, heads, acc, n_draws=2, seed=0, keep=False)) == {"removed", "random removed",
                                                                                   "excess drop"}


def test_layer_versus_random_draws_antithetic_pairs():
    m = MODELS["llama"]
    acc = lambda: sum(alive(m, 1, h) for h in range(4)) / 4  # what is left of layer 1
    # any 4 of the 8 heads with k in layer 1 leave 1 - k/4; its complement leaves k/4: each pair's mean is 1/2
    got = ablation.layer_versus_random(m, (0, 1), acc, n_draws=8, seed=3)
    assert got == {"removed": 0.0, "random removed": 0.5, "excess drop": 0.5}
    ctl = ablation.layer_versus_random(m, (0, 1), acc, n_draws=8, seed=3, control=True)
    assert ctl == {"removed": 0.5, "random removed": 0.5, "excess drop": 0.0}
    # the removals evaluated, in order: draw 1, draw 2 (its complement), then the aggregate layer's heads
    removed = []
    dead = lambda: {l: [h for h in range(4) if not alive(m, l, h)] for l in (0, 1)}
    ablation.layer_versus_random(m, (0, 1), lambda: removed.append(dead()) or 0.0, n_draws=2, seed=3)
    first = {l: hs for l, hs in removed[0].items() if hs}
    assert first == ablation.random_heads(m, (0, 1), 4, torch.Generator().manual_seed(3))  # a plain draw
    pairs = [{(l, h) for l, hs in r.items() for h in hs} for r in removed]
    assert len(pairs[0]) == len(pairs[1]) == 4 and not pairs[0] & pairs[1]  # the complement
    assert pairs[2] == {(1, h) for h in range(4)}


def test_head_sweep_pads_layers_with_fewer_heads_with_nan():
    from lab.models import tiny_hybrid

    torch.manual_seed(0)
    m = tiny_hybrid(vocab_size=12, d_model=32, layout="MA", n_heads=2, head_dim=16).eval()  # 4 SSD heads, 2 attention
    x = torch.randint(0, 12, (4, 6), generator=torch.Generator().manual_seed(0))
    score = lambda: float(m(input_ids=x).logits[:, -1, 0].mean())
    drop = ablation.head_sweep(m, [0, 1], score)
    assert drop.shape == (2, 4) and torch.isnan(drop[1, 2:]).all() and not torch.isnan(drop[:, :2]).any()
    with hooks.ablate_heads(m, {1: [1]}):
        removed = score()
    assert math.isclose(float(drop[1, 1]), score() - removed, rel_tol=1e-6, abs_tol=1e-7)
