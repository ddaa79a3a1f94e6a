"""The generic MoE helpers against references: fused-expert views, block inputs, experts swapped by a function."""

import pytest
import torch
import torch.nn.functional as F

from lab.moe import blocks


def test_capture_shapes(model, xs):
    assert len(xs) == 3 and all(x.shape == (64, 32) for x in xs)


def test_capture_is_the_mlp_input(model, ids, xs):
    """The captured input of each MoE block, by a hand-registered pre-hook on the block."""
    seen = []
    h = model.model.layers[2].mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        h.remove()
    assert torch.equal(xs[2], seen[0].reshape(-1, 32))


def test_weight_views_reproduce_the_moe_block(model, xs):
    """Σ_e w_e · expert(e) with our gate/up/down views equals transformers' fused MoE block."""
    mlp = blocks.moe_blocks(model)[1]
    ours = blocks.moe_out(mlp, xs[1], lambda e, x: blocks.expert(x, *blocks.weights(mlp, e)))
    with torch.no_grad():
        ref = mlp(xs[1][None])[0]
    assert torch.allclose(ours, ref, atol=1e-6)


def test_expert_is_eq1():
    """(SiLU(x W_gateᵀ) ⊙ x W_upᵀ) W_downᵀ, by a loop over tokens and neurons."""
    g = torch.Generator().manual_seed(0)
    x, Wg, Wu, Wd = (torch.randn(s, generator=g) for s in ((3, 8), (12, 8), (12, 8), (8, 12)))
    ref = torch.zeros(3, 8)
    for i in range(3):
        for j in range(12):
            ref[i] += F.silu(x[i] @ Wg[j]) * (x[i] @ Wu[j]) * Wd[:, j]
    assert torch.allclose(blocks.expert(x, Wg, Wu, Wd), ref, atol=1e-5)


def test_route_is_the_router(model, xs):
    mlp = blocks.moe_blocks(model)[0]
    logits, w, idx = blocks.route(mlp, xs[0])
    assert torch.allclose(logits, xs[0] @ mlp.gate.weight.T, atol=1e-6)
    assert torch.equal(idx, logits.softmax(-1).topk(2, -1).indices) and torch.allclose(w.sum(-1), torch.ones(64))


def test_use_experts_swaps_and_restores(model, ids):
    batch = {"input_ids": ids, "labels": ids}
    base = blocks.eval_loss(model, batch)
    dense = lambda l, e, x: blocks.expert(x, *blocks.weights(blocks.moe_blocks(model)[l], e))
    assert blocks.eval_loss(model, batch, dense) == pytest.approx(base, abs=1e-5)
    assert blocks.eval_loss(model, batch, lambda l, e, x: torch.zeros_like(x), layers=[1]) != pytest.approx(base)
    assert blocks.eval_loss(model, batch) == base
    assert blocks.layer_errors(model, blocks.moe_inputs(model, ids), dense).abs().max() < 1e-10


def test_use_experts_puts_the_original_modules_back(model, ids):
    before = [b.experts for b in blocks.moe_blocks(model)]
    with blocks.use_experts(model, lambda l, e, x: torch.zeros_like(x), layers=[0, 2]):
        inside = [b.experts for b in blocks.moe_blocks(model)]
        assert inside[1] is before[1] and inside[0] is not before[0] and inside[2] is not before[2]
    assert all(a is b for a, b in zip(before, (b.experts for b in blocks.moe_blocks(model))))
    with pytest.raises(RuntimeError), blocks.use_experts(model, blocks.dense_fn(model)):
        raise RuntimeError("inside")
    assert all(a is b for a, b in zip(before, (b.experts for b in blocks.moe_blocks(model))))


def test_layer_errors_by_hand(model, xs):
    """Zeroing one expert: the relative error per layer by a loop over tokens and their routed experts."""
    dense = blocks.dense_fn(model)
    fn = lambda l, e, x: torch.zeros_like(x) if e == 1 else dense(l, e, x)
    got = blocks.layer_errors(model, xs, fn)
    assert blocks.layer_errors(model, xs, blocks.dense_fn(model)).abs().max() == 0
    for l, (mlp, x) in enumerate(zip(blocks.moe_blocks(model), xs)):
        _, w, idx = blocks.route(mlp, x)
        num = den = 0.0
        for t in range(len(x)):
            y = sum(w[t, s] * blocks.expert(x[t:t + 1], *blocks.weights(mlp, int(e)))[0] for s, e in enumerate(idx[t]))
            y1 = sum(w[t, s] * blocks.expert(x[t:t + 1], *blocks.weights(mlp, int(e)))[0]
                     for s, e in enumerate(idx[t]) if e != 1)
            num, den = num + (y1 - y).pow(2).sum().item(), den + y.pow(2).sum().item()
        assert got[l].item() == pytest.approx(num / den, rel=1e-4)
