"""GPTQ (lab.compress.gptq) against an independent reference: the exact re-solve of the remaining columns."""

from __future__ import annotations

import copy

import pytest
import torch

from lab.compress import gptq as gq
from lab.compress.quant import fake_quant
from lab.compress.rotate import QuantSpec, Rotations, linears, online, quantize_model
from lab.models.zoo import tiny_llama


def _problem(seed=0, out=12, k=40, n=200):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g, dtype=torch.float64) / k**0.5
    X = torch.randn(n, k, generator=g, dtype=torch.float64) @ (torch.eye(k, dtype=torch.float64) + 2 * mix)
    return torch.randn(out, k, generator=g, dtype=torch.float64), X  # correlated inputs: GPTQ has work to do


def _reference(W, H, bits, percdamp=0.01, sym=False):
    """Column by column: round column i onto the grid, then set the not yet rounded columns F to the exact minimiser
    of (W' − W) H (W' − W)ᵀ given the rounded ones Q: Δ_F = −Δ_Q H_QF H_FF⁻¹ (a linear solve, no Cholesky trick)."""
    s, z, qmin, qmax = gq.grid(W, bits, sym=sym)
    H = H + percdamp * H.diagonal().mean() * torch.eye(len(H), dtype=H.dtype)
    k, cur, Q = W.shape[1], W.clone(), torch.zeros_like(W)
    for i in range(k):
        Q[:, i] = gq.round_to(cur[:, i], s, z, qmin, qmax)
        q, f = slice(0, i + 1), slice(i + 1, k)
        if i + 1 < k:
            dQ = Q[:, q] - W[:, q]
            cur[:, f] = W[:, f] - torch.linalg.solve(H[f, f], (dQ @ H[q, f]).T).T
    return Q


@pytest.mark.parametrize("blocksize,sym", [(128, False), (16, False), (7, True)])
def test_gptq_equals_the_exact_sequential_re_solve(blocksize, sym):
    W, X = _problem()
    H = gq.hessian(X)
    got = gq.gptq(W, H, 4, blocksize=blocksize, sym=sym)
    torch.testing.assert_close(got, _reference(W, H, 4, sym=sym), atol=1e-9, rtol=0)


def test_gptq_lies_on_the_rtn_grid_and_beats_rtn_on_the_layer_output():
    W, X = _problem(1)
    got, rtn = gq.gptq(W, gq.hessian(X), 3), fake_quant(W, 3)
    s, z, _, _ = gq.grid(W, 3)
    codes = got / s + z
    assert (codes - codes.round()).abs().max() < 1e-6 and codes.min() >= -1e-6 and codes.max() <= 7 + 1e-6
    err = lambda V: ((V - W) @ X.T).norm().item()
    assert err(got) < 0.8 * err(rtn), (err(got), err(rtn))
    assert (got != rtn).any()  # not RTN by another name
    # with an identity Hessian (uncorrelated inputs) no column can absorb another's error: GPTQ is RTN
    torch.testing.assert_close(gq.gptq(W, torch.eye(40, dtype=torch.float64), 3, percdamp=0), rtn)


def _inputs(model, lin, ids):  # the raw input (before any online Hadamard), by a hook of its own
    seen = []
    h = lin.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in seen])


def test_gptq_model_follows_quarot_order_and_inputs_and_leaves_the_weights_to_gptq():
    """Within a block q/k/v see the unquantized stream, down_proj the inputs that the quantized q…up produce, after
    R4's online Hadamard; afterwards the forward quantizes activations and KV at 4 bits and no longer re-rounds the
    weights (every weight on its original 4-bit per-row grid)."""
    torch.manual_seed(0)
    m = tiny_llama(vocab_size=30, d_model=32, n_layers=2, n_heads=4, d_ff=64).eval()
    ids = torch.randint(1, 30, (16, 10))
    qs, rot = QuantSpec(4, 4, 4), Rotations.draw(m.config, 0)
    fp = quantize_model(m, qs.off(), rot, r1=True, choice=[{"R2": True, "R3": True, "R4": True}] * 2)
    ref = copy.deepcopy(fp)
    q = gq.gptq_model(fp, ids, qs)
    for layer, before in zip(q.model.layers, ref.model.layers):
        for name, lin in linears(layer).items():
            s, z, _, _ = gq.grid(linears(before)[name].weight, 4)
            codes = lin.weight.double() / s + z
            assert (codes - codes.round()).abs().max() < 1e-3 and codes.round().min() >= 0 and codes.round().max() <= 15
    l0, r0 = linears(q.model.layers[0]), linears(ref.model.layers[0])
    want_q = gq.gptq(r0["q"].weight, gq.hessian(_inputs(ref, r0["q"], ids)), 4)
    torch.testing.assert_close(l0["q"].weight.double(), want_q.float().double())
    down0 = r0["down"].weight.detach().clone()
    with torch.no_grad():
        for name in ("q", "k", "v", "o", "gate", "up"):
            r0[name].weight.copy_(l0[name].weight)
    x = _inputs(ref, r0["down"], ids)
    want_down = gq.gptq(down0, gq.hessian(online(x, r0["down"].had)), 4)
    torch.testing.assert_close(l0["down"].weight.double(), want_down.float().double())
    assert (gq.gptq(down0, gq.hessian(x), 4) - want_down).abs().max() > 1e-3  # the Hadamard matters
    for layer in q.model.layers:
        for lin in linears(layer).values():
            assert lin.qs.w_bits == 16 and lin.qs.a_bits == 4
        assert layer.mlp.down_proj.had is not None and layer.self_attn.roste["qs"].kv_bits == 4
    assert q.config.roste["weights"].startswith("GPTQ")
