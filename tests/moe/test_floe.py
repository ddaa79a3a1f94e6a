"""FloE pieces against references: Eq. 5/6, the FloE expert's two forms, quantization, predictors, controls."""

import math

import pytest
import torch
import torch.nn.functional as F

from lab.compress.quant import quantize
from lab.models.zoo import tiny_mixtral
from lab.moe import blocks
from lab.moe import floe as fl
from lab.moe import floe_predictors as fpred
from lab.moe.links import SimLink, TimeModel
from lab.moe.offload import OffloadEngine


def test_sparsifier_and_variants():
    a = torch.tensor([-3.0, -0.5, 0.2, 1.0])
    assert torch.equal(fl.sparsify(a, 1.0), torch.tensor([-3.0, 0.0, 0.0, 1.0]))  # |a| ≥ t is kept (Eq. 5)
    g = torch.Generator().manual_seed(0)
    x, Wg, Wu, Wd = (torch.randn(s, generator=g) for s in ((5, 8), (12, 8), (12, 8), (8, 12)))
    dense = (F.silu(x @ Wg.T) * (x @ Wu.T)) @ Wd.T
    for on in fl.MATRICES:
        assert torch.allclose(fl.expert_out(x, Wg, Wu, Wd, on, 0.0), dense, atol=1e-6)
        assert torch.count_nonzero(fl.expert_out(x, Wg, Wu, Wd, on, 1e9)) == 0
    t = 0.7  # naive per-element reference for the up variant (FloE, Eq. 11)
    h = torch.zeros(5, 12)
    for i in range(5):
        for j in range(12):
            up = float(x[i] @ Wu[j])
            h[i, j] = F.silu(x[i] @ Wg[j]) * (up if abs(up) >= t else 0.0)
    assert torch.allclose(fl.expert_out(x, Wg, Wu, Wd, "up", t), h @ Wd.T, atol=1e-5)
    with pytest.raises(ValueError, match="activation"):
        fl.expert_out(x, Wg, Wu, Wd, "attn")


def test_quantile_is_eq6():
    m = torch.tensor([4.0, 1.0, 3.0, 2.0])
    assert fl._quantile(m, torch.tensor([0.25, 0.5, 0.6, 1.0])).tolist() == [1.0, 2.0, 3.0, 4.0]


def test_thresholds_per_expert_reach_the_target_sparsity(model, xs):
    t = fl.thresholds(model, xs, 0.8, "up")
    assert t.shape == (3, 4)
    for l, (mlp, x) in enumerate(zip(blocks.moe_blocks(model), xs)):
        _, _, idx = blocks.route(mlp, x)
        for e in range(4):
            a = fl.activations(x[(idx == e).any(-1)], *blocks.weights(mlp, e))["up"].abs()
            assert (a < t[l, e]).float().mean() == pytest.approx(0.8, abs=0.01)
    many = fl.thresholds(model, xs, [0.5, 0.8], "gate")
    assert many.shape == (2, 3, 4) and (many[1] >= many[0]).all()
    pooled = fl.thresholds(model, xs, 0.8, "up", per_expert=False)
    assert (pooled == pooled[:, :1]).all()


def test_floe_thresholds_are_eq6_on_the_int2_up(model, xs):
    """FloE's thresholds are Eq. 6 on |x W_up| with the INT2 W_up its mask thresholds (a naive quantile over a
    token-by-token loop); the mask then keeps 1 − k of the up neurons on those tokens, where thresholds calibrated
    on the full-precision W_up keep more (the INT2 a_up is noisier); the controls pick the other calibrations."""
    k = 0.8
    t = fl.floe_thresholds(model, xs, k, group_size=16)
    for l, (mlp, x) in enumerate(zip(blocks.moe_blocks(model), xs)):
        _, _, idx = blocks.route(mlp, x)
        for e in range(4):
            Wu = quantize(blocks.weights(mlp, e)[1].detach(), 2, 16).dequantize()  # (48, 32) INT2 W_up
            mags = sorted(abs(float(x[i] @ Wu[j])) for i in range(len(x)) if e in idx[i].tolist()
                          for j in range(len(Wu)))
            assert float(t[l, e]) == pytest.approx(mags[math.ceil(k * len(mags)) - 1], rel=1e-5), (l, e)
    experts = fl.floe_experts(model, t, group_size=16)
    assert fl.kept_fraction(experts, model, xs) == pytest.approx(1 - k, abs=0.005)
    t_fp = fl.thresholds(model, xs, k, "up")
    assert fl.kept_fraction(experts, model, xs, t=t_fp) > 1 - k + 0.02
    assert torch.equal(fl.floe_thresholds(model, xs, k, group_size=16, control="fp_thresholds"), t_fp)
    assert torch.equal(fl.floe_thresholds(model, xs, k, control="gate_for_up"), fl.thresholds(model, xs, k, "gate"))
    t0 = fl.floe_thresholds(model, xs, k, control="whole_experts")
    assert t0.shape == t.shape and not t0.any()  # every neuron kept
    assert fl.kept_fraction(fl.floe_experts(model, t0, group_size=16), model, xs) == 1.0


@pytest.mark.parametrize("t, want", [(0.0, 1.0), (float("inf"), 0.0), (None, None)])
def test_kept_fraction_is_the_per_token_share(model, xs, t, want):
    """The kept fraction against a token-by-token loop over each token's routed experts (layers 1..), with the
    experts' own thresholds and with other thresholds passed in."""
    thr = fl.thresholds(model, xs, 0.7, "up") if t is None else torch.full((3, 4), t)
    experts = fl.floe_experts(model, thr)
    other = fl.thresholds(model, xs, 0.5, "up")

    def naive(t_of, layers=(1, 2)):
        kept = total = 0
        for l, (mlp, x) in enumerate(zip(blocks.moe_blocks(model), xs)):
            _, _, idx = blocks.route(mlp, x)
            for i in range(len(x)) if l in layers else ():
                for e in idx[i].tolist():
                    m = (x[i:i + 1] @ experts[l, e].Wu.T).abs() >= t_of(l, e)
                    kept, total = kept + m.sum().item(), total + m.numel()
        return kept / total

    own = lambda l, e: experts[l, e].t
    got = fl.kept_fraction(experts, model, xs)
    assert got == pytest.approx(naive(own), abs=1e-9)
    assert fl.kept_fraction(experts, model, xs, t=other) == pytest.approx(naive(lambda l, e: other[l, e]), abs=1e-9)
    assert fl.kept_fraction(experts, model, xs, layers=(2,)) == pytest.approx(naive(own, (2,)), abs=1e-9)
    if want is not None:
        assert got == want
    else:
        assert 0.3 < got < 0.45  # above the 30 % the full-precision thresholds were set for: the INT2 a_up is noisier


def test_quant_fn_changes_only_its_matrix(model, xs, monkeypatch):
    """The matrices each expert is computed with: the quantized one differs from the model's weight (and
    takes at most 2 values per group of 16 at 1 bit), every other one is bit-identical; the model is untouched."""
    seen = {}

    def record(x, *W):
        seen["W"] = W
        return x

    monkeypatch.setattr(fl, "expert_out", record)  # quant_fn's expert computes through fl.expert_out
    before = [p.detach().clone() for p in model.parameters()]
    for target in (("gate",), ("up",), ("down",), ("gate", "down")):
        fn = fl.quant_fn(model, target[0] if len(target) == 1 else target, 1, 16)
        for l in range(3):
            for e in range(4):
                seen.clear()
                fn(l, e, xs[l][:2])
                for name, used, orig in zip(fl.MATRICES, seen["W"], blocks.weights(blocks.moe_blocks(model)[l], e)):
                    if name in target:
                        assert not torch.equal(used, orig), (target, l, e, name)
                        groups = used.reshape(-1, 16)  # HQQ groups run along the rows (16 of 32 or 48 entries)
                        assert all(len(g.unique()) <= 2 for g in groups)
                    else:
                        assert torch.equal(used, orig), (target, l, e, name)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    monkeypatch.undo()
    err = {m: blocks.layer_errors(model, xs, fl.quant_fn(model, m, 1, 16)).mean() for m in fl.MATRICES}
    assert all(v > 0 for v in err.values())
    assert blocks.layer_errors(model, xs, fl.quant_fn(model, "up", 8, 16)).max() < 1e-3


def test_floe_expert_gathered_equals_masked_dense(model, xs):
    t = fl.thresholds(model, xs, 0.8, "up")
    experts = fl.floe_experts(model, t)
    ex = experts[1, 2]
    x = xs[1][:20]
    assert torch.allclose(ex.gathered(x), ex(x), atol=1e-5)
    _, m = ex.mask(x)
    assert 0 < m.float().mean() < 1
    ref = fl.expert_out(x, ex.Wg, ex.Wu, ex.Wd_t.T, "up", ex.t)  # same thing through the generic variant
    assert torch.allclose(ex(x), ref, atol=1e-5)
    assert ex.Wq_up.nbits == 2 and ex.Wq_up.bits_per_weight() == pytest.approx(2 + 32 / 32)  # one group per row


def test_predictors_perfect_when_layers_agree(model, xs):
    stats = fpred.predictor_stats(model, [xs[1], xs[1], xs[1]], 0.25)
    assert [s["layer"] for s in stats] == [1, 2]
    for s in stats:
        assert s["cos"] == pytest.approx(1.0) and s["intra"] == pytest.approx(1.0) and s["inter"] == 1.0
    real = fpred.predictor_stats(model, xs, 0.25)
    assert all(0 <= s[k] <= 1 for s in real for k in ("inter", "intra"))


def test_inter_predictor_learns_the_next_router(model):
    """Trained on 192 tokens, both predictors find the next layer's top-2 experts on 64 held-out tokens far
    better than the constant baseline that always predicts the two most frequent training experts."""
    ids = torch.randint(40, (8, 32), generator=torch.Generator().manual_seed(2))
    xs = blocks.moe_inputs(model, ids)
    nxt = blocks.moe_blocks(model)[2]
    logits = blocks.route(nxt, xs[2])[0].detach()  # (256, 4) the next layer's true router logits
    tr, te = slice(0, 192), slice(192, 256)

    def overlap(pred, true):  # unordered top-2 overlap, by a loop over tokens
        hits = [len(set(p.topk(2).indices.tolist()) & set(t.topk(2).indices.tolist())) for p, t in zip(pred, true)]
        return sum(hits) / (2 * len(hits))

    counts = torch.bincount(logits[tr].topk(2, -1).indices.flatten(), minlength=4).float()
    const = overlap(counts.expand(64, 4), logits[te])
    assert const < 0.65  # the baseline is no oracle on this data (≈ 0.58)
    for hidden, kw in ((0, dict(epochs=30, lr=1e-2)), (16, dict(epochs=60, lr=1e-2))):  # linear (router init), MLP
        net = fpred.train_inter_predictor(xs[1][tr], logits[tr], nxt.gate.weight.detach(), hidden=hidden, batch=16,
                                          **kw)
        with torch.no_grad():
            assert net(xs[1]).shape == (256, 4)
            assert overlap(net(xs[1][te]), logits[te]) > const + 0.25, hidden  # measured ≈ 0.91 for both


def test_shifted_exponential_fit():
    z = torch.distributions.Exponential(10.0).sample((200_000,))
    lam, c = fl.fit_shifted_exponential(z - fl.SILU_MIN)
    assert lam == pytest.approx(10.0, rel=0.02) and c == pytest.approx(-F.silu(torch.tensor(-1.2785)).item(), abs=1e-4)


def test_theorem_errors_closed_form_and_order():
    """The up term has a closed form (App. A); at the paper's fitted λ ≈ 10.5 the order is down < up < gate."""
    normal = torch.distributions.Normal(0.0, 1.0)
    for eta in (0.1, 0.2, 0.3):
        z = normal.icdf(torch.tensor(1 - eta / 2))
        closed = 1 - eta - 2 * z * normal.log_prob(z).exp()
        L = fl.theorem_errors(eta, lam=10.5)
        assert L["up"] == pytest.approx(float(closed), abs=0.01)
        assert L["down"] < L["up"] < L["gate"]
    low = fl.theorem_errors(0.2, lam=2.0)  # λc ≈ 0.56, outside the theorem's λc ≥ 2: gate beats up
    assert low["gate"] < low["up"]


# ---------------------------------------------------------------- the notebook's controls (floe.CONTROLS)

def test_unknown_control_is_rejected(model):
    with pytest.raises(ValueError, match="not a control"):
        fl.sparse_fn(model, torch.zeros(3, 4), "up", control="randm_mask")
    with pytest.raises(ValueError, match="unknown"):
        OffloadEngine(model, "floe", SimLink(TimeModel()), predictor="nope")


def test_random_like_keeps_the_count_per_row_but_not_the_positions():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(50, 40, generator=g)
    mask = a.abs() >= a.abs().quantile(0.8)
    r = fl.random_like(mask, g)
    assert torch.equal(r.sum(-1), mask.sum(-1))
    assert (r & mask).sum() < 0.5 * mask.sum()  # a random 20 % overlaps the magnitude mask by about 20 %


def test_mask_source_swaps_only_gate_and_up():
    assert [fl.mask_source(on) for on in fl.MATRICES] == ["gate", "up", "down"]
    assert [fl.mask_source(on, "gate_for_up") for on in fl.MATRICES] == ["up", "gate", "down"]
    assert [fl.mask_source(on, "random_mask") for on in fl.MATRICES] == ["gate", "up", "down"]


def test_random_mask_erases_the_sparsity_ordering(model, xs):
    """Magnitude masks order the errors (down least); random masks of the same size lose that order:
    sparsifying a_down at random costs about as much as sparsifying a_up at random."""
    t = {on: fl.thresholds(model, xs, 0.8, on) for on in fl.MATRICES}
    err = {on: blocks.layer_errors(model, xs, fl.sparse_fn(model, t[on], on))[1:].mean().item() for on in fl.MATRICES}
    rnd = {on: blocks.layer_errors(model, xs, fl.sparse_fn(model, t[on], on, "random_mask"))[1:].mean().item()
           for on in fl.MATRICES}
    assert err["down"] < 0.7 * err["up"]
    assert 0.7 < rnd["down"] / rnd["up"] < 1.4
    assert all(rnd[on] > 2 * err[on] for on in fl.MATRICES)


def test_floe_expert_controls(model, xs):
    x = xs[1]
    t_up, t_gate = fl.thresholds(model, xs, 0.75, "up"), fl.thresholds(model, xs, 0.75, "gate")
    ex = fl.floe_experts(model, t_up)[1, 0]
    swapped = fl.floe_experts(model, t_gate, control="gate_for_up")[1, 0]
    rnd = fl.floe_experts(model, t_up, control="random_mask")[1, 0]
    a_up, m = ex.mask(x)
    _, m_gate = swapped.mask(x)
    _, m_rnd = rnd.mask(x)
    Wg = blocks.weights(blocks.moe_blocks(model)[1], 0)[0]
    assert torch.equal(m_gate, torch.nn.functional.silu(x @ Wg.T).abs() >= t_gate[1, 0])
    assert torch.equal(m_rnd.sum(-1), m.sum(-1)) and not torch.equal(m_rnd, m)
    assert torch.equal(rnd.mask(x)[1], m_rnd)  # the same x gets the same random mask, so both forms agree
    assert torch.allclose(rnd.gathered(x[:8]), rnd(x[:8]), atol=1e-5)
    err = lambda f: (f(x) - ex(x)).pow(2).sum() / ex(x).pow(2).sum()  # error vs the FloE expert
    assert err(rnd) > 1.3 * err(swapped)  # a random mask of FloE's size departs more than CATS' gate mask


def test_random_predictor_is_near_chance(model, xs):
    real = fpred.predictor_stats(model, xs, 0.25)
    rnd = fpred.predictor_stats(model, xs, 0.25, control="random_predictor")
    for r, q in zip(real, rnd):
        assert q["cos"] == r["cos"]
        assert abs(q["intra"] - 0.25) < 0.08  # a random quarter of the neurons recalls about a quarter
        assert q["inter"] < r["inter"]


def test_random_predictor_in_the_engine_misses_and_moves_more(model):
    seq = torch.randint(40, (1, 12), generator=torch.Generator().manual_seed(2))
    tm = TimeModel.mixtral_equivalent(32, 48)
    _, real = OffloadEngine(model, "floe", SimLink(tm), keep=0.25).run(seq)
    _, rnd = OffloadEngine(model, "floe", SimLink(tm), keep=0.25, predictor="random").run(seq)
    assert rnd.misses > real.misses
    assert sum(rnd.bytes) > sum(real.bytes) and sum(rnd.seconds) > sum(real.seconds)


def test_config_for_scale_and_controls():
    smoke, full = fl.Config.for_scale("smoke"), fl.Config.for_scale("full")
    assert (smoke.steps, smoke.n_seq, smoke.predictor_epochs, smoke.n_decode) == (200, 64, 10, 1)
    assert (full.steps, full.n_seq, full.predictor_epochs, full.n_decode) == (1500, 256, 20, 8)
    assert smoke.trained and smoke.predictor == "router"
    assert not fl.Config.for_scale("smoke", "untrained").trained
    assert fl.Config.for_scale("smoke", "random_predictor").predictor == "random"
    assert fl.Config.for_scale("smoke", "whole_experts").whole_experts and not smoke.whole_experts
    for c in ("random_mask", "gate_for_up", "fp_thresholds"):  # mask controls act through `control=` arguments
        assert fl.Config.for_scale("smoke", c) == smoke
    assert smoke.pooled_k in smoke.ks and set(smoke.offloaded) == set(range(1, smoke.n_layers))
    with pytest.raises(ValueError, match="not a control"):
        fl.Config.for_scale("smoke", "nope")
    with pytest.raises(ValueError, match="scale"):
        fl.Config.for_scale("big")
    m = tiny_mixtral(**smoke.arch(40))
    assert len(blocks.moe_blocks(m)) == 4 and blocks.moe_blocks(m)[0].experts.down_proj.shape == (8, 64, 192)


def test_floe_fn_is_the_experts(model, xs):
    experts = fl.floe_experts(model, fl.thresholds(model, xs, 0.8, "up"))
    fn = fl.floe_fn(experts)
    assert torch.equal(fn(2, 1, xs[2][:5]), experts[2, 1](xs[2][:5]))
    assert fl.check_control("") == "" and fl.check_control("untrained") == "untrained"
