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


def _reference(W, H, bits, percdamp=0.01, sym=False, grid=None):
    """Column by column: round column i onto the grid, then set the not yet rounded columns F to the exact minimiser
    of (W' − W) H (W' − W)ᵀ given the rounded ones Q: Δ_F = −Δ_Q H_QF H_FF⁻¹ (a linear solve, no Cholesky trick)."""
    s, z, qmin, qmax = grid or gq.grid(W, bits, sym=sym)
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


@pytest.mark.parametrize("bits,clip,sym", [(3, 1.0, False), (4, 0.9, False), (3, 0.9, True), (4, 1.0, True)])
def test_with_an_identity_hessian_gptq_is_fake_quant(bits, clip, sym):
    """No column can absorb another's error when the inputs are uncorrelated: GPTQ rounds to nearest on the grid,
    which must then be `fake_quant`'s (same scale, zero, clip and code range)."""
    W, _ = _problem(2)
    got = gq.gptq(W, torch.eye(40, dtype=torch.float64), bits, clip=clip, sym=sym, percdamp=0)
    torch.testing.assert_close(got, fake_quant(W, bits, clip=clip, sym=sym), atol=1e-6, rtol=0)  # fake_quant: fp32


@pytest.mark.parametrize("sym", [False, True])
def test_mse_clip_search_picks_each_rows_best_shrink_like_quarot(sym):
    """QuaRot's `find_params(mse=True)`: per row the p ∈ {1, 0.99, …, 0.21} of least Σ|Q_p(w) − w|^2.4, here by
    brute force over `fake_quant(clip=p)`; a row with an outlier gets a narrower range."""
    W, _ = _problem(3)
    W[0, 0] = 8.0  # an outlier row: the best clip is well below 1
    s, z, qmin, qmax = gq.grid(W, 3, sym=sym, mse=True)
    ps = [1 - i / 100 for i in range(80)]
    for r in range(W.shape[0]):
        errs = [(fake_quant(W[r:r + 1], 3, clip=p, sym=sym) - W[r:r + 1]).abs().pow(2.4).sum().item() for p in ps]
        want = fake_quant(W[r:r + 1], 3, clip=ps[min(range(80), key=errs.__getitem__)], sym=sym)
        torch.testing.assert_close(gq.round_to(W[r:r + 1], s[r:r + 1], z[r:r + 1], qmin, qmax), want)
    s1, _, _, _ = gq.grid(W, 3, sym=sym)
    assert (s <= s1 + 1e-12).all() and s[0].item() < s1[0].item()  # never wider; the outlier row's range shrank


def test_a_dead_input_column_is_zeroed_and_the_rest_is_still_exact():
    """An input that is always 0 (H's row and column 0): QuaRot sets H_ii = 1 and zeroes the weight column (on the
    grid found before); the reference on that modified problem must agree."""
    W, X = _problem(4)
    X[:, 5] = 0
    H = gq.hessian(X)
    got = gq.gptq(W, H, 4)
    Hm, Wm = H.clone(), W.clone()
    Hm[5, 5], Wm[:, 5] = 1.0, 0.0
    torch.testing.assert_close(got, _reference(Wm, Hm, 4, grid=gq.grid(W, 4)), atol=1e-9, rtol=0)
    s, z, qmin, qmax = gq.grid(W, 4)
    torch.testing.assert_close(got[:, 5], gq.round_to(torch.zeros(W.shape[0], dtype=W.dtype), s, z, qmin, qmax))


def _inputs(model, lin, ids):  # the raw input (before any online Hadamard), by a hook of its own
    seen = []
    h = lin.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in seen])


def test_gptq_model_follows_quarot_order_and_inputs_and_leaves_the_weights_to_gptq():
    """Block by block, and within a block q/k/v on the stream before any of it is quantized, o after q/k/v, down after
    q…up and after R4's online Hadamard, the next block after the whole previous one (checked by rebuilding each
    Hessian from a copy of the model with the weights GPTQ set so far); afterwards the forward quantizes activations
    and KV at 4 bits and no longer re-rounds the weights (every weight on its 4-bit per-row grid)."""
    torch.manual_seed(0)
    m = tiny_llama(vocab_size=30, d_model=32, n_layers=2, n_heads=4, d_ff=64).eval()
    ids = torch.randint(1, 30, (16, 10))
    qs, rot = QuantSpec(4, 4, 4), Rotations.draw(m.config, 0)
    fp = quantize_model(m, qs.off(), rot, r1=True, choice=[{"R2": True, "R3": True, "R4": True}] * 2)
    ref = copy.deepcopy(fp)
    q = gq.gptq_model(fp, ids, qs)
    for layer, before in zip(q.model.layers, ref.model.layers):
        for name, lin in linears(layer).items():
            s, z, _, _ = gq.grid(linears(before)[name].weight, 4, mse=True)
            codes = lin.weight.double() / s + z
            assert (codes - codes.round()).abs().max() < 1e-3 and codes.round().min() >= 0 and codes.round().max() <= 15
    done, orig = [linears(b) for b in q.model.layers], [linears(b) for b in ref.model.layers]
    W0 = [{k: v.weight.detach().clone() for k, v in d.items()} for d in orig]

    def expect(layer, name, upstream, hadamard=True):  # ref with `upstream` = [(layer, name)] set to GPTQ's weights
        with torch.no_grad():
            for i, d in enumerate(orig):
                for k, lin in d.items():
                    lin.weight.copy_(done[i][k].weight if (i, k) in upstream else W0[i][k])
        x = _inputs(ref, orig[layer][name], ids)
        if hadamard and orig[layer][name].had is not None:
            x = online(x, orig[layer][name].had)
        return gq.gptq(W0[layer][name], gq.hessian(x), 4, mse=True)

    before_o = [(0, k) for k in ("q", "k", "v")]
    before_down = before_o + [(0, k) for k in ("o", "gate", "up")]
    for layer, name, upstream in ((0, "q", []), (0, "o", before_o), (0, "down", before_down),
                                  (1, "q", before_down + [(0, "down")])):
        torch.testing.assert_close(done[layer][name].weight.double(), expect(layer, name, upstream).float().double())
    assert (expect(0, "down", before_down, hadamard=False) - expect(0, "down", before_down)).abs().max() > 1e-3
    assert (expect(0, "o", []) - expect(0, "o", before_o)).abs().max() > 1e-3  # the order is visible in o
    for layer in q.model.layers:
        for lin in linears(layer).values():
            assert lin.qs.w_bits == 16 and lin.qs.a_bits == 4
        assert layer.mlp.down_proj.had is not None and layer.self_attn.roste["qs"].kv_bits == 4
    assert q.config.roste["weights"].startswith("GPTQ")
